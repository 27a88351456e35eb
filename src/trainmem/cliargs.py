"""Options shared by every command that takes a model and a step, and their conversion to specs.

Each option's help is written here, beside it; its default is read from the spec dataclass
(:func:`spec_default`), so the library and every command share one default. Converting the
parsed options builds the specs, whose validation names any bad value (exit code 2).
"""

from __future__ import annotations

import argparse
import math
from dataclasses import fields, replace

from trainmem.errors import SpecError
from trainmem.specs import ImplSpec, ModelSpec, StepSpec
from trainmem.specs.impl import ATTENTIONS, COMPILE_SCOPES, FRAMEWORKS, PROFILES, RECOMPUTE_FROMS, RECOMPUTES
from trainmem.specs.step import DEFAULT_SEQ, LOSSES, OPTIMIZERS, PRECISIONS, default_seq

__all__ = ["positive_int", "positive_float", "add_model_step_args", "specs_from_args", "step_impl_from_args",
           "resolve_attention",
           "DEFAULT_MODEL",
           "add_finetune_args", "finetune_from_args", "add_inference_args", "serving_from_args", "add_head_args"]

DEFAULT_MODEL = "llama-3-8b"
PRECISION_HELP = (f"{', '.join(PRECISIONS)}: pure bf16/fp16; amp-* autocast over fp32 weights; mixed-* fp32 "
                  "master; fsdp-bf16 needs --fsdp; megatron-bf16 has fp32 grads; aliases hf-bf16 = amp-bf16 "
                  "(HF Trainer bf16=True), torchtune-bf16 = bf16")
OPTIMIZER_HELP = (f"{', '.join(OPTIMIZERS)} (rmsprop, adagrad: torch.optim; adam8bit, adamw8bit, lion*, "
                  "rmsprop8bit/32bit, ademamix*, paged-*: bitsandbytes; paged states are reported apart from "
                  "the peak; torchao-*: torchao's low-bit AdamW; docs/optimizers.md)")


def spec_default(spec: type, name: str):
    """A spec field's default: the one place the library and every command take defaults from."""
    return next(f.default for f in fields(spec) if f.name == name)


def positive_int(field: str):
    """An argparse type for ``--field``: a positive integer (``_`` separators allowed), else the
    one-line ``--field=value: must be ...`` error."""
    def parse(text: str) -> int:
        try:
            value = int(text.replace("_", ""))
        except ValueError:
            raise argparse.ArgumentTypeError(f"--{field}={text!r}: must be an integer") from None
        if value <= 0:
            raise argparse.ArgumentTypeError(f"--{field}={value}: must be positive")
        return value
    parse.__name__ = field
    return parse


def comma_list(field: str):
    """An argparse type for ``--field A,B``: names without empty items or repeats (which name is
    known is the spec's to say), else a one-line ``--field=value: ...`` error."""
    def parse(text: str) -> str:
        items = text.split(",")
        if not all(x.strip() for x in items):
            raise argparse.ArgumentTypeError(f"--{field}={text!r}: an empty item (give names, comma-separated)")
        if len(set(items)) != len(items):
            raise argparse.ArgumentTypeError(f"--{field}={text!r}: a name repeated")
        return text
    parse.__name__ = field
    return parse


def positive_float(field: str):
    """An argparse type for ``--field``: a finite positive number, else a one-line error."""
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"--{field}={text!r}: must be a number") from None
        if not value > 0:
            raise argparse.ArgumentTypeError(f"--{field}={value}: must be positive")
        if not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"--{field}={text!r}: must be a finite number")
        return value
    parse.__name__ = field
    return parse


def add_model_step_args(p: argparse.ArgumentParser) -> None:
    """--model, --batch, --seq, --grad-accum, --precision, --optimizer, --loss, --attention,
    --recompute, --recompute-every, --recompute-from, --profile, --device."""
    p.add_argument("--model", default=DEFAULT_MODEL,
                   help=f"preset name or path to a Hugging Face config.json / model folder (default {DEFAULT_MODEL})")
    from functools import partial

    step, impl = partial(spec_default, StepSpec), partial(spec_default, ImplSpec)
    p.add_argument("--batch", type=positive_int("batch"), default=step("batch"), help=f"micro-batch size B (default {step('batch')})")
    p.add_argument("--seq", type=positive_int("seq"), default=None,
                   help=f"sequence length S (default {DEFAULT_SEQ}, or the model's learned positions if fewer)")
    p.add_argument("--grad-accum", type=positive_int("grad-accum"), default=step("grad_accum"),
                   help="micro-batches per optimizer step")
    p.add_argument("--precision", choices=PRECISIONS, default=step("precision"), metavar="NAME",
                   help=f"{PRECISION_HELP} (default {step('precision')})")
    p.add_argument("--optimizer", choices=OPTIMIZERS, metavar="NAME", default=step("optimizer"), help=OPTIMIZER_HELP)
    p.add_argument("--loss", choices=LOSSES, default=step("loss"),
                   help="ce (full fp32 logits), chunked-ce, fused-ce; torchtune-chunked-ce, "
                   "litgpt-chunked-ce (the frameworks' own chunked losses: docs/losses.md)")
    p.add_argument("--attention", choices=ATTENTIONS + ("memory-efficient",), default=None,
                   help="eager (materialized softmax), sdpa (PyTorch picks the kernel), flash, sdpa-math, "
                        f"mem-efficient (default: the model family's, {impl('attention')}; eager for gpt-oss and "
                        "Gemma-2, which transformers builds without SDPA)")
    p.add_argument("--recompute", choices=RECOMPUTES, default=impl("recompute"),
                   help="activation checkpointing: none, selective (attention core), full (every block), "
                        "every-k (every k-th block), op (torchtitan's op-level policy)")
    p.add_argument("--recompute-every", type=positive_int("recompute-every"), default=None,
                   help="K for --recompute every-k, which needs it: every K-th block checkpointed (torchtitan's "
                        "selective_ac_option, torchtune's ac_option)")
    p.add_argument("--recompute-from", choices=RECOMPUTE_FROMS, default=None,
                   help="with every-k, which blocks: kth (K-1, 2K-1, ...: torchtitan's and torchtune's count, the "
                        "default) or first (0, K, 2K, ...: transformers' every_n_layers, what --hf-args reads)")
    p.add_argument("--profile", choices=PROFILES, default=impl("profile"),
                   help="whose saved set is modelled: hf, reference, megatron, traced (read off a fake-tensor "
                        "trace; --device cpu)")
    p.add_argument("--device", choices=("cuda", "cpu"), default=impl("device"),
                   help=f"kernels modelled (default {impl('device')}; compare: cpu only, its trace runs CPU kernels)")


def add_routing_arg(p: argparse.ArgumentParser) -> None:
    """--routing: the MoE routing assumption (``ImplSpec.routing``)."""
    p.add_argument("--routing", default=spec_default(ImplSpec, "routing"), metavar="balanced|skewed:F|worst",
                   help="MoE routing assumption: every expert gets its top-k share (balanced, default), a "
                        "fraction F of the tokens choose the same k experts (skewed:F), or all do (worst)")


def add_optimizer_args(p: argparse.ArgumentParser) -> None:
    """--optimizer-impl, --optimizer-in-backward: how and where ``optimizer.step()`` runs
    (``ImplSpec.optimizer_impl`` / ``optimizer_in_backward``)."""
    from trainmem.specs.impl import OPTIMIZER_IMPLS

    p.add_argument("--optimizer-impl", choices=OPTIMIZER_IMPLS, default=spec_default(ImplSpec, "optimizer_impl"),
                   help="foreach (a parameter-sized temporary), fused (none), for-loop (per tensor), or auto: "
                        "torch's default on --device (foreach on cuda, for-loop on cpu)")
    p.add_argument("--optimizer-in-backward", action="store_true",
                   help="step each parameter in its gradient hook (torchtune's optimizer_in_bwd): gradients "
                        "are never all alive; needs --grad-accum 1")


def add_framework_arg(p: argparse.ArgumentParser) -> None:
    """--framework: whose decoder-block code the hf profile models (``ImplSpec.framework``, docs/litgpt.md)."""
    p.add_argument("--framework", choices=FRAMEWORKS, default=spec_default(ImplSpec, "framework"),
                   help="whose decoder-block code the hf profile models: hf (transformers, default) or litgpt "
                        "(LitGPT's Block, RMSNorm and LoRAQKVLinear; Llama, GPT-NeoX and Gemma blocks: "
                        "docs/litgpt.md) or lit-gpt "
                        "(its Oct 2023 lit_gpt package: RMSNorm in the input dtype)")


def add_compile_arg(p: argparse.ArgumentParser) -> None:
    """--compile: the model runs under torch.compile (``ImplSpec.compile``, docs/compile.md)."""
    p.add_argument("--compile", action="store_true",
                   help="the model runs under torch.compile: what inductor's min-cut partition keeps for "
                        "backward, not what eager autograd keeps (docs/compile.md)")
    p.add_argument("--compile-scope", choices=COMPILE_SCOPES, default=spec_default(ImplSpec, "compile_scope"),
                   help="with --compile: model (one torch.compile of the whole model, default), block (each "
                        "decoder block compiled alone; embedding, final norm, head and loss eager: torchtitan) or "
                        "block-loss (the blocks and the loss compiled alone: torchtune)")


def add_float8_args(p: argparse.ArgumentParser) -> None:
    """--float8, --float8-all-gather: torchao Float8 training (``ImplSpec.float8``, docs/float8.md)."""
    from trainmem.specs.impl import FLOAT8S

    p.add_argument("--float8", choices=FLOAT8S, default=spec_default(ImplSpec, "float8"),
                   help="torchao Float8 training (convert_to_float8_training): linears with dims multiple of 16 "
                        "run fp8 matmuls, the head stays bf16; tensorwise or rowwise scales (default none)")
    p.add_argument("--float8-all-gather", action="store_true",
                   help="with --fsdp and --float8 tensorwise: all-gather the converted weights in fp8 "
                        "(torchtitan's enable_fsdp_float8_all_gather)")


def add_head_args(p: argparse.ArgumentParser, heads: tuple[str, ...] | None = None) -> None:
    """--head, --num-labels: the task head (``ModelSpec.head``; ``estimate/heads.py``)."""
    from trainmem.specs.model import HEADS

    more = ", seq2seq (encoder-decoder); default: the config's architectures, else" if heads else "; default:"
    p.add_argument("--head", choices=heads or HEADS, default=None,
                   help="the model's head: lm (causal LM), mlm (masked LM), seq-cls (sequence classification), "
                        f"token-cls (token classification){more} lm for decoders, mlm for encoders")
    p.add_argument("--num-labels", type=positive_int("num-labels"), default=None,
                   help="classes of a seq-cls or token-cls head (default 2)")


def _with_head(args: argparse.Namespace, model: ModelSpec) -> ModelSpec:
    head, labels = getattr(args, "head", None), getattr(args, "num_labels", None)
    if labels is not None and (head or model.head) not in ("seq-cls", "token-cls"):
        raise SpecError("num_labels", labels, "needs --head seq-cls or token-cls")
    given = {k: v for k, v in (("head", head), ("num_labels", labels)) if v is not None}
    model = replace(model, **given) if given else model
    # transformers' ForSequenceClassificationLoss: one label is regression (MSELoss), not the cross-entropy modelled
    if model.head == "seq-cls" and model.num_labels == 1:
        raise SpecError("num_labels", 1, "a seq-cls head with one label is regression (MSELoss in transformers), "
                                         "which is not modelled: single-label classification needs 2 or more")
    return model


def _traced_model(args: argparse.Namespace) -> ModelSpec | None:
    """Under --profile traced, a model type the estimator does not map still has a ModelSpec
    (``estimate/traced``); None otherwise."""
    if getattr(args, "profile", None) != "traced":
        return None
    from trainmem.estimate.traced import unmapped_model_spec
    return unmapped_model_spec(args.model)


def specs_from_args(args: argparse.Namespace) -> tuple[ModelSpec, StepSpec, ImplSpec]:
    from trainmem.inputs import model_from_args

    model = _with_head(args, _traced_model(args) or model_from_args(args))
    if args.seq is None:
        args.seq = default_seq(model.max_positions)
    resolve_attention(args, model.family)
    return (model, *step_impl_from_args(args))


def resolve_attention(args: argparse.Namespace, family: str) -> None:
    """``--attention`` left out (None): the family's default kernel (``Family.attentions``, first)."""
    if getattr(args, "attention", None) is None:
        from trainmem.families import default_attention
        args.attention = default_attention(family)


def recompute_every_from_args(args: argparse.Namespace) -> int:
    """``ImplSpec.recompute_every`` from --recompute and --recompute-every: K only with every-k, and
    every-k only with K (no silent K; torchtitan's selective_ac_option and torchtune's ac_option name it)."""
    every = args.recompute_every
    if every is not None and args.recompute != "every-k":
        raise SpecError("recompute_every", every, f"needs --recompute every-k, not {args.recompute}")
    if every is None and args.recompute == "every-k":
        raise SpecError("recompute_every", every, "--recompute every-k needs --recompute-every K (every K-th block "
                                                  "checkpointed; K=1 is --recompute full)")
    return every or 1


def recompute_from_from_args(args: argparse.Namespace) -> dict:
    """``ImplSpec.recompute_from`` from --recompute-from (a file's, such as --hf-args' ``every_n_layers``, or
    the option): only with every-k, whose count it picks; left out, the spec's default (kth)."""
    start = getattr(args, "recompute_from", None)
    if start is None:
        return {}
    if args.recompute != "every-k":
        raise SpecError("recompute_from", start, f"--recompute-from needs --recompute every-k, not {args.recompute}")
    return {"recompute_from": start}


def step_impl_from_args(args: argparse.Namespace) -> tuple[StepSpec, ImplSpec]:
    """The step and implementation specs alone (for commands that build the model themselves:
    they resolve ``args.seq`` with :func:`~trainmem.specs.step.default_seq` and ``args.attention`` with
    :func:`resolve_attention` first)."""
    from trainmem.inputs import spec_fields

    seq = default_seq() if args.seq is None else args.seq  # a file's seq = 0 is an error, not the default
    step = StepSpec(batch=args.batch, seq=seq, grad_accum=args.grad_accum, precision=args.precision,
                    optimizer=args.optimizer, loss=args.loss, **spec_fields(args, "step"))
    every = recompute_every_from_args(args)
    routing = {"routing": args.routing} if getattr(args, "routing", None) else {}  # commands with add_routing_arg
    # add_optimizer_args, add_compile_arg, add_float8_args
    optim = {k: getattr(args, k) for k in ("optimizer_impl", "optimizer_in_backward", "compile", "compile_scope",
                                           "float8", "float8_all_gather", "framework") if hasattr(args, k)}
    attention = {"attention": args.attention} if args.attention is not None else {}  # else resolve_attention's
    impl = ImplSpec(profile=args.profile, recompute=args.recompute, recompute_every=every, device=args.device,
                    **{**attention, **routing, **optim, **recompute_from_from_args(args), **spec_fields(args, "impl")})
    if impl.compile and impl.framework != "hf":  # the compiled rules read transformers' blocks, not LitGPT's
        raise SpecError("framework", impl.framework, "--compile is modelled for transformers' modules "
                                                     "(--framework hf), not LitGPT's")
    return step, impl


# fine-tuning (commands that model it opt in: estimate, plan) ------------------------------------

def _names(field: str):
    def parse(text: str) -> tuple[str, ...]:
        names = tuple(n.strip() for n in text.split(",") if n.strip())
        if not names:
            raise argparse.ArgumentTypeError(f"--{field}={text!r}: needs at least one name")
        return names
    parse.__name__ = field
    return parse


def _float(field: str):
    def parse(text: str) -> float:
        try:
            return float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"--{field}={text!r}: must be a number") from None
    parse.__name__ = field
    return parse


#: flag -> FinetuneSpec field, for flags that only make sense with adapters
_LORA_FLAGS = {"lora_rank": "--lora-rank", "lora_alpha": "--lora-alpha", "lora_targets": "--lora-targets",
               "lora_dropout": "--lora-dropout", "adapter_dtype": "--adapter-dtype"}
#: flag -> FinetuneSpec field, for flags that only make sense with a 4-bit base
_QLORA_FLAGS = {"qlora_scope": "--qlora-scope", "double_quant": "--double-quant", "quantize_head": "--quantize-head",
                "quant_impl": "--quant-impl"}


def add_finetune_args(p: argparse.ArgumentParser) -> None:
    """--finetune, --finetune-preset, --lora-rank, --lora-alpha, --lora-targets, --lora-dropout,
    --adapter-dtype, --freeze, and qlora's --qlora-scope, --double-quant, --quantize-head, --quant-impl.
    Precedence: flags > preset > FinetuneSpec defaults."""
    from trainmem.specs.finetune import ADAPTER_DTYPES, MODES, QLORA_SCOPES, QUANT_IMPLS

    g = p.add_argument_group("fine-tuning")
    g.add_argument("--finetune", choices=MODES, default=None,
                   help="full (with --freeze), lora (frozen base + adapters), qlora (4-bit NF4 base + adapters)")
    g.add_argument("--finetune-preset", default=None, metavar="NAME",
                   help="a bundled recipe, e.g. lora-r16-all, lora-r8-attn, qlora-r64-all (flags override it)")
    g.add_argument("--lora-rank", type=positive_int("lora-rank"), default=None, help="adapter rank r (default 8)")
    g.add_argument("--lora-alpha", type=_float("lora-alpha"), default=None, help="peft lora_alpha (default 8)")
    g.add_argument("--lora-targets", type=_names("lora-targets"), default=None, metavar="NAMES",
                   help="comma-separated module names, or all-linear (default: peft's default for the "
                        "model type: q_proj,v_proj for Llama-style models, c_attn for GPT-2, query,value for BERT)")
    g.add_argument("--lora-dropout", type=_float("lora-dropout"), default=None, help="adapter input dropout (default 0)")
    g.add_argument("--adapter-dtype", choices=ADAPTER_DTYPES, default=None,
                   help="adapter weights' dtype (default float32: peft upcasts 16-bit adapters)")
    g.add_argument("--freeze", type=_names("freeze"), default=None, metavar="PATTERNS",
                   help="comma-separated: embeddings, layers.0-11, or module names/prefixes (implies --finetune full)")
    g.add_argument("--qlora-scope", choices=QLORA_SCOPES, default=None,
                   help="qlora: which linears are 4-bit: all but the head (default: transformers/bitsandbytes, "
                        "torchtune >= 0.3) or only those with adapters (targeted: torchtune <= 0.2)")
    g.add_argument("--double-quant", action=argparse.BooleanOptionalAction, default=None,
                   help="qlora: quantize the absmax constants to 8 bits (bnb_4bit_use_double_quant; default on)")
    g.add_argument("--quantize-head", action="store_true", default=None,
                   help="qlora: the (untied) output head is 4-bit too (llm_int8_skip_modules=[])")
    g.add_argument("--quant-impl", choices=QUANT_IMPLS, default=None,
                   help="qlora: storage of a 4-bit weight: bnb (bitsandbytes, default), bnb-legacy (bitsandbytes "
                        "< 0.43.2, whose MatMul4Bit holds each 4-bit linear's input until the graph is freed) "
                        "or torchao-nf4 (torchao's NF4Tensor, as torchtune uses)")


def finetune_from_args(args: argparse.Namespace):
    """The FinetuneSpec the fine-tuning flags describe, or None when none was given."""
    from trainmem.specs.finetune import FinetuneSpec

    given = {f: getattr(args, f) for f in (*_LORA_FLAGS, *_QLORA_FLAGS, "freeze") if getattr(args, f, None) is not None}
    from trainmem.inputs import spec_fields
    given.update({k: v for k, v in spec_fields(args, "finetune").items() if k not in given})  # file fields, no flag
    if getattr(args, "finetune", None):
        given["mode"] = args.finetune
    preset = getattr(args, "finetune_preset", None)
    if preset is None and not given:
        return None
    if preset is not None:
        from trainmem.estimate.finetune import load_preset
        spec = load_preset(preset, **given)
    else:
        spec = FinetuneSpec(**given)
    if not spec.adapters:
        for name, flag in _LORA_FLAGS.items():
            if name in given:
                raise SpecError(name, given[name], f"{flag} needs --finetune lora or qlora, not {spec.mode}")
    if spec.adapters and "freeze" in given:  # specs/finetune.py trainable_by_name: adapters train, the base is frozen
        raise SpecError("freeze", ",".join(given["freeze"]), f"--freeze needs --finetune full: under {spec.mode} the "
                                                             "base is frozen already and every adapter trains")
    if spec.mode != "qlora":
        for name, flag in _QLORA_FLAGS.items():
            if name in given:
                raise SpecError(name, given[name], f"{flag} needs --finetune qlora, not {spec.mode}")
    return spec


def add_inference_args(p: argparse.ArgumentParser) -> None:
    """--context --block-size --weights --weight-group --kv-dtype --prefill-chunk --gpu-memory-utilization
    (``estimate --mode inference``; the rest is ignored in training mode and refused there when given)."""
    from trainmem.estimate.inference import VLLM_GPU_MEMORY_UTILIZATION
    from trainmem.estimate.inference_weights import KV_DTYPES, WEIGHT_FORMATS

    g = p.add_argument_group("serving (--mode inference; per rank under --tp/--pp)")
    g.add_argument("--context", type=positive_int("context"), default=None,
                   help="tokens each sequence's KV cache holds (default --seq)")
    g.add_argument("--block-size", type=positive_int("block-size"), default=16,
                   help="paged KV-cache block in tokens (default 16; 1 = unpaged)")
    g.add_argument("--weights", choices=tuple(WEIGHT_FORMATS), default=None,
                   help="weight format of the block linears (default: as --precision stores them); "
                        "int4 = AWQ packing with fp16 group scales")
    g.add_argument("--weight-group", type=positive_int("weight-group"), default=None, help="int4: group size (default 128)")
    g.add_argument("--kv-dtype", choices=tuple(KV_DTYPES), default=None,
                   help="KV-cache dtype (default: the activation dtype)")
    g.add_argument("--prefill-chunk", type=positive_int("prefill-chunk"), default=None,
                   help="chunked prefill: prompt tokens per forward")
    g.add_argument("--gpu-memory-utilization", type=_float("gpu-memory-utilization"), default=None,
                   help=f"with --gpu: share of capacity the server may use (vLLM's default "
                        f"{VLLM_GPU_MEMORY_UTILIZATION}); prints the concurrent sequences that fit")


_SERVING_FLAGS = {"weights": "--weights", "weight_group": "--weight-group", "kv_dtype": "--kv-dtype",
                  "prefill_chunk": "--prefill-chunk", "gpu_memory_utilization": "--gpu-memory-utilization",
                  "context": "--context"}


def serving_from_args(args: argparse.Namespace, seq: int) -> dict:
    """Keyword arguments of ``inference_estimate`` from :func:`add_inference_args`'s options; in training
    mode none may be given (a serving flag there would be silently ignored)."""
    given = {k: getattr(args, k) for k in _SERVING_FLAGS if getattr(args, k) is not None}
    if args.step_mode != "inference":
        for name, value in given.items():
            raise SpecError(name, value, f"{_SERVING_FLAGS[name]} needs --mode inference")
        return {}
    _refuse_training_flags(args)
    if "weight_group" in given and given.get("weights") != "int4":
        raise SpecError("weight_group", given["weight_group"], "--weight-group needs --weights int4")
    if "gpu_memory_utilization" in given and args.gpu is None:
        raise SpecError("gpu_memory_utilization", given["gpu_memory_utilization"], "needs --gpu")
    given.setdefault("context", seq)
    return {**given, "block_size": args.block_size}


#: training options a serving estimate (``inference_estimate``) has no use for: (spec, field) -> flag
_TRAINING_FLAGS = {(StepSpec, "optimizer"): "--optimizer", (StepSpec, "loss"): "--loss",
                   (StepSpec, "grad_accum"): "--grad-accum", (ImplSpec, "recompute"): "--recompute",
                   (ImplSpec, "optimizer_impl"): "--optimizer-impl",
                   (ImplSpec, "optimizer_in_backward"): "--optimizer-in-backward", (ImplSpec, "compile"): "--compile",
                   (ImplSpec, "float8"): "--float8"}


def _refuse_training_flags(args: argparse.Namespace) -> None:
    """Under --mode inference a training option off its default is refused, not ignored."""
    for (spec, name), flag in _TRAINING_FLAGS.items():
        value = getattr(args, name, None)
        if value is not None and value != spec_default(spec, name):
            raise SpecError(name, value, f"{flag} is a training option: --mode inference has no optimizer, "
                                         "backward or loss")
    if finetune_from_args(args) is not None:
        raise SpecError("finetune", getattr(args, "finetune", None) or "preset",
                        "fine-tuning options are training options: --mode inference serves the base model")


def add_parallel_args(p: argparse.ArgumentParser) -> None:
    """--dp --tp --sp --cp --cp-style --ep --pp --schedule --virtual-stages --microbatches
    --layer-split --zero --fsdp --fsdp-group --fsdp-version --no-reshard-after-forward --no-loss-parallel
    --offload."""
    from trainmem.specs.parallel import OFFLOADS, SCHEDULES

    g = p.add_argument_group("parallelism (per-rank results)")
    for flag, what in (("dp", "data-parallel replicas"), ("tp", "tensor-parallel degree"),
                       ("cp", "context-parallel degree"), ("ep", "expert-parallel degree"),
                       ("pp", "pipeline stages"), ("virtual-stages", "chunks per pipeline rank (interleaved)"),
                       ("microbatches", "micro-batches per pipeline flush"),
                       ("fsdp-group", "ranks per shard group for --fsdp hybrid (default 8: one node)")):
        g.add_argument(f"--{flag}", type=positive_int(flag), default=None, help=what)
    g.add_argument("--sp", action="store_true", help="sequence parallelism on top of --tp")
    g.add_argument("--cp-style", choices=("ring", "allgather"), default="ring",
                   help="context parallel: ring (K/V blocks passed around) or allgather (K/V gathered once)")
    g.add_argument("--schedule", choices=SCHEDULES, default="1f1b", help="pipeline schedule (default 1f1b)")
    g.add_argument("--layer-split", default=None, metavar="N,N,...", help="layers per pipeline stage (uneven)")
    g.add_argument("--zero", type=int, choices=(0, 1, 2, 3), default=0, help="ZeRO stage")
    g.add_argument("--fsdp", choices=("full", "hybrid"), default=None,
                   help="FSDP sharding: full (= ZeRO-3) or hybrid (shard within a node, replicate across)")
    g.add_argument("--fsdp-version", type=int, choices=(1, 2), default=2,
                   help="2: fully_shard, per-parameter shards (default); 1: FullyShardedDataParallel with "
                        "use_orig_params, one padded flat parameter per block (its gradient covers frozen weights)")
    g.add_argument("--fsdp-units", choices=("blocks", "blocks+embed+head"), default="blocks",
                   help="FSDP2 units: blocks (the root keeps embedding and head gathered all step; default) or "
                        "blocks+embed+head (own units, gathered only in use: torchtitan, torchtune's "
                        "custom_sharded_layers)")
    g.add_argument("--no-reshard-after-forward", action="store_true",
                   help="FSDP keeps gathered parameters from forward to backward")
    g.add_argument("--no-loss-parallel", action="store_true",
                   help="TP: all-gather the full-vocabulary logits before the loss (default: loss_parallel, "
                        "logits and loss sharded V/tp per rank, torchtitan's default)")
    g.add_argument("--offload", type=comma_list("offload"), default=None, metavar="WHAT[,WHAT]",
                   help=f"comma list of {', '.join(OFFLOADS)}; with --fsdp, params is FSDP's CPU offload "
                        "(CPUOffloadPolicy: sharded parameters, gradients and optimizer states on the host)")


def parallel_from_args(args: argparse.Namespace):
    """A ParallelSpec from the options of :func:`add_parallel_args` (None when all are defaults)."""
    from trainmem.inputs import spec_fields
    from trainmem.specs.parallel import ParallelSpec

    split = ()
    if args.layer_split:
        try:
            split = tuple(int(x) for x in args.layer_split.split(","))
        except ValueError:
            raise SpecError("layer_split", args.layer_split, "must be comma-separated integers") from None
    offload = args.offload or ()  # the flag's comma list, or a file's tuple (--deepspeed, --hf-args)
    offload = tuple(x for x in offload.split(",") if x) if isinstance(offload, str) else tuple(offload)
    kwargs = {k: getattr(args, k.replace("-", "_")) for k in
              ("dp", "tp", "cp", "ep", "pp", "virtual_stages", "microbatches", "fsdp_group")}
    kwargs = {k: v for k, v in kwargs.items() if v is not None}
    kwargs.update(spec_fields(args, "parallel"))
    if getattr(args, "no_loss_parallel", False):  # the flag, or torchtitan's disable_loss_parallel
        kwargs["loss_parallel"] = False
    par = ParallelSpec(**kwargs, sp=args.sp, cp_style=args.cp_style, schedule=args.schedule,
                       layer_split=split, zero=args.zero, fsdp=args.fsdp, fsdp_version=args.fsdp_version,
                       fsdp_units=getattr(args, "fsdp_units", "blocks"),
                       reshard_after_forward=not args.no_reshard_after_forward, offload=offload)
    _refuse_unused_sharding_flags(args, par)
    return None if par.is_single and par.pp == 1 else par


def _refuse_unused_sharding_flags(args: argparse.Namespace, par) -> None:
    """Sharding options that only act under a sharding they were given without: refused, not ignored."""
    if args.no_reshard_after_forward and par.fsdp is None and par.zero != 3:
        raise SpecError("reshard_after_forward", False, "--no-reshard-after-forward needs --fsdp (or --zero 3): "
                                                         "nothing is resharded without them")
    if args.fsdp_group is not None and par.fsdp != "hybrid":
        raise SpecError("fsdp_group", args.fsdp_group, f"--fsdp-group needs --fsdp hybrid, not {par.fsdp or 'none'}")
    if getattr(args, "float8_all_gather", False) and par.fsdp is None:  # commands with add_float8_args
        raise SpecError("float8_all_gather", True, "--float8-all-gather needs --fsdp (FSDP2 all-gathers the fp8 "
                                                   "weights; without it nothing is gathered)")
