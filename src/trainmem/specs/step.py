"""StepSpec: what one training step does (batch, sequence, precision, optimizer, loss)."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Literal

from trainmem.errors import SpecError
from trainmem import validate as v

__all__ = ["StepSpec", "PRECISIONS", "PRECISION_ALIASES", "RECIPES", "OPTIMIZERS", "LOSSES", "Precision",
           "DEFAULT_SEQ", "default_seq", "describe_precision"]

RECIPES = ("fp32", "bf16", "fp16", "amp-bf16", "amp-fp16", "mixed-bf16", "mixed-fp16", "fsdp-bf16", "megatron-bf16")
PRECISION_ALIASES = {
    # Hugging Face Trainer, TrainingArguments(bf16=True): the model stays fp32 and the forward runs
    # under torch.autocast (transformers/trainer.py, Trainer.autocast_smart_context_manager via
    # accelerate's mixed_precision="bf16"; training_args.py, TrainingArguments.bf16).
    "hf-bf16": "amp-bf16",
    # torchtune, `dtype: bf16`: the model is built and loaded in bf16 and the optimizer steps bf16
    # parameters (torchtune/training/precision.py, get_dtype and set_default_dtype).
    "torchtune-bf16": "bf16",
}
PRECISIONS = RECIPES + tuple(PRECISION_ALIASES)
OPTIMIZERS = ("adamw", "adam", "sgd", "sgd-momentum", "adafactor", "rmsprop", "adagrad", "adam8bit", "adamw8bit",
              "paged-adamw8bit", "paged-adamw32bit", "lion32bit", "lion8bit", "paged-lion8bit", "paged-lion32bit",
              "rmsprop8bit", "rmsprop32bit", "ademamix", "ademamix8bit", "torchao-adamw8bit", "torchao-adamw4bit",
              "torchao-adamw4bit-block256")
LOSSES = ("ce", "chunked-ce", "fused-ce", "torchtune-chunked-ce", "litgpt-chunked-ce")
#: the frameworks' own chunked losses (estimate/losses.py, trace/losses.py), and their chunking
FRAMEWORK_LOSSES = ("torchtune-chunked-ce", "litgpt-chunked-ce")
TORCHTUNE_CHUNKS = 8  # CEWithChunkedOutputLoss(num_output_chunks=8), every recipe's default
LITGPT_CHUNK = 128  # lm_head_chunk_size=128 in litgpt/finetune/*.py
MAX_TOKENS = 2**40  # batch x sequence beyond this cannot be a real step
DEFAULT_SEQ = 4096  # the sequence length when none is given (StepSpec, estimate(), every command)


def default_seq(max_positions: int = 0) -> int:
    """The sequence length used when none is given: :data:`DEFAULT_SEQ`, or a model's learned
    positions (``ModelSpec.max_positions``) when it has fewer. The library and every command call
    this, so they agree."""
    return min(DEFAULT_SEQ, max_positions) if max_positions else DEFAULT_SEQ


@dataclass(frozen=True)
class Precision:
    """Dtypes of each ledger under one precision recipe."""

    param: str
    """Parameters as stored (the parameter ledger; FSDP's shards)."""
    grad: str
    master: str | None
    state: str
    activation: str
    autocast: bool
    compute: str
    """Weights as the kernels read them: ``param``, or under FSDP2's
    ``MixedPrecisionPolicy(param_dtype=...)`` the all-gathered copy cast to ``param_dtype``."""

    @property
    def gathered(self) -> bool:
        """Compute weights are FSDP's cast all-gather outputs, so the recipe needs FSDP."""
        return self.compute != self.param and not self.autocast


_PRECISION = {
    "fp32": Precision("float32", "float32", None, "float32", "float32", False, "float32"),
    "bf16": Precision("bfloat16", "bfloat16", None, "bfloat16", "bfloat16", False, "bfloat16"),
    "fp16": Precision("float16", "float16", None, "float16", "float16", False, "float16"),
    "amp-bf16": Precision("float32", "float32", None, "float32", "bfloat16", True, "float32"),
    "amp-fp16": Precision("float32", "float32", None, "float32", "float16", True, "float32"),
    "mixed-bf16": Precision("bfloat16", "bfloat16", "float32", "float32", "bfloat16", False, "bfloat16"),
    "mixed-fp16": Precision("float16", "float16", "float32", "float32", "float16", False, "float16"),
    # FSDP2 fully_shard(mp_policy=MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)), as
    # torchtitan applies it (torchtitan/models/llama3/infra/parallelize.py, apply_fsdp): fp32 shards,
    # gradients reduce-scattered into fp32 shards, fp32 optimizer states, no master copy; the
    # all-gather casts to bf16, so every kernel sees bf16 weights and no autocast runs
    # (torch/distributed/fsdp/_fully_shard/_fsdp_param.py, FSDPParam.init_dtype_attrs, all_gather_inputs;
    # the fp32 reduce: _fsdp_collectives.py, foreach_reduce).
    "fsdp-bf16": Precision("float32", "float32", None, "float32", "bfloat16", False, "bfloat16"),
    # Megatron-LM --bf16: bf16 parameters (args.params_dtype), fp32 main gradients
    # (megatron/training/arguments.py, validate_args: "bfloat16 requires gradient accumulation and
    # all-reduce to be done in fp32" sets accumulate_allreduce_grads_in_fp32 unless
    # --grad-reduce-in-bf16; the fp32 grad buffer: megatron/core/distributed/param_and_grad_buffer.py),
    # fp32 main parameters and Adam states (megatron/core/optimizer/optimizer.py,
    # Float16OptimizerWithFloat16Params / distrib_optimizer.py). mixed-bf16 is the same with bf16
    # gradients (Megatron's --grad-reduce-in-bf16): 2 bytes per parameter fewer.
    "megatron-bf16": Precision("bfloat16", "float32", "float32", "float32", "bfloat16", False, "bfloat16"),
}

_SHORT = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}
#: optimizer -> its states, for tensors large enough to quantize (estimate/state_items.py)
_LOW_BIT_STATES = {"adam8bit": "8-bit blockwise", "adamw8bit": "8-bit blockwise",
                   "paged-adamw8bit": "paged 8-bit blockwise", "paged-adamw32bit": "paged fp32", "torchao-adamw8bit": "8-bit blockwise",
                   "torchao-adamw4bit": "4-bit blockwise", "lion32bit": "fp32", "lion8bit": "8-bit blockwise",
                   "paged-lion8bit": "paged 8-bit blockwise", "paged-lion32bit": "paged fp32",
                   "rmsprop8bit": "8-bit blockwise", "rmsprop32bit": "fp32", "ademamix": "fp32",
                   "ademamix8bit": "8-bit blockwise", "torchao-adamw4bit-block256": "4-bit blockwise"}


def describe_precision(name: str) -> str:
    """One line saying what the precision keeps (weights, gradients, master copy, optimizer states,
    activations), read off its :class:`Precision`; an alias names its recipe: ``hf-bf16 = amp-bf16:
    fp32 weights, fp32 grads, no master, fp32 optimizer states, bf16 activations (autocast)``."""
    v.one_of("precision", name, PRECISIONS)
    recipe = PRECISION_ALIASES.get(name, name)
    d, s = _PRECISION[recipe], _SHORT
    weights = f"{s[d.param]} shards gathered in {s[d.compute]}" if d.gathered else f"{s[d.param]} weights"
    master = f"{s[d.master]} master" if d.master else "no master"
    parts = (weights, f"{s[d.grad]} grads", master, f"{s[d.state]} optimizer states",
             f"{s[d.activation]} activations" + (" (autocast)" if d.autocast else ""))
    return f"{name if name == recipe else f'{name} = {recipe}'}: {', '.join(parts)}"


@dataclass(frozen=True, kw_only=True)
class StepSpec:
    """One optimizer step of training (or one forward pass for inference)."""

    batch: int = 1
    """Micro-batch size B (sequences per forward/backward)."""
    seq: int = DEFAULT_SEQ
    """Sequence length S in tokens (default 4096; :func:`default_seq` fits it to a model)."""
    grad_accum: int = 1
    """Micro-batches accumulated per optimizer step (does not raise the activation peak)."""
    precision: str = "bf16"
    """fp32; pure bf16/fp16 (no master copy); amp-bf16/amp-fp16 (torch.autocast, fp32 states);
    mixed-bf16/mixed-fp16 (16-bit params and grads, fp32 master weights and optimizer states);
    fsdp-bf16 (FSDP2's MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32): fp32 shards,
    gradients and states, bf16 all-gathered weights and activations; needs FSDP); megatron-bf16
    (mixed-bf16 with fp32 main gradients). Aliases, kept as typed and echoed in outputs:
    hf-bf16 (= amp-bf16), torchtune-bf16 (= bf16)."""
    optimizer: str = "adamw"
    """torch's adamw, adam, sgd, sgd-momentum, adafactor, rmsprop (``RMSprop``: no momentum, not
    centered) and adagrad (``Adagrad``); bitsandbytes' adam8bit (Adam8bit), adamw8bit (AdamW8bit),
    paged-adamw8bit (PagedAdamW8bit), paged-adamw32bit (PagedAdamW32bit), lion32bit (Lion32bit),
    lion8bit (Lion8bit), paged-lion8bit (PagedLion8bit), paged-lion32bit (PagedLion32bit),
    rmsprop8bit (RMSprop8bit), rmsprop32bit (RMSprop32bit), ademamix (``AdEMAMix``, 32-bit: three
    states, two momenta and the variance) and ademamix8bit (AdEMAMix8bit); torchao's torchao-adamw8bit and
    torchao-adamw4bit (``torchao.optim.AdamW8bit``/``AdamW4bit``), and torchao-adamw4bit-block256
    (``AdamW4bit(block_size=256)``, what transformers' ``adamw_torch_4bit`` builds). docs/optimizers.md has their
    state layouts and step temporaries."""
    loss: str = "ce"
    """ce (full fp32 logits), chunked-ce (logits per chunk, recomputed in backward), fused-ce
    (fused linear + cross-entropy, gradient computed in forward); the frameworks' own chunked
    losses: torchtune-chunked-ce (``CEWithChunkedOutputLoss`` with the model's 8 output chunks:
    bf16 logits, one chunk upcast at a time, every chunk's fp32 log-softmax kept) and
    litgpt-chunked-ce (``lm_head_chunk_size=128`` + ``chunked_cross_entropy``: CE on the bf16
    logits, no upcast, the logits held by the loop). docs/losses.md has the formulas."""
    mode: Literal["train", "inference"] = "train"
    """train (forward, backward, optimizer) or inference (prefill + KV cache)."""

    def __post_init__(self) -> None:
        v.positive("batch", self.batch, maximum=MAX_TOKENS)
        v.positive("seq", self.seq, maximum=MAX_TOKENS)
        v.positive("grad_accum", self.grad_accum, maximum=10**7)
        if self.batch * self.seq > MAX_TOKENS:
            raise SpecError("seq", self.seq, f"with batch={self.batch} exceeds {MAX_TOKENS} tokens per micro-batch")
        v.one_of("precision", self.precision, PRECISIONS)
        v.one_of("optimizer", self.optimizer, OPTIMIZERS)
        v.one_of("loss", self.loss, LOSSES)
        v.one_of("mode", self.mode, ("train", "inference"))

    @property
    def recipe(self) -> str:
        """The canonical recipe name (an alias resolved: hf-bf16 -> amp-bf16)."""
        return PRECISION_ALIASES.get(self.precision, self.precision)

    @property
    def precision_description(self) -> str:
        """:func:`describe_precision`, with a low-bit optimizer's own state layout in place of the
        recipe's state dtype (bitsandbytes and torchao keep their states whatever the recipe says)."""
        text = describe_precision(self.precision)
        states = _LOW_BIT_STATES.get(self.optimizer)
        if states is None:
            return text
        return text.replace(f"{_SHORT[self.dtypes.state]} optimizer states",
                            f"{states} optimizer states ({self.optimizer})")

    @property
    def dtypes(self) -> Precision:
        return _PRECISION[self.recipe]

    @property
    def tokens(self) -> int:
        return self.batch * self.seq

    def to_dict(self) -> dict:
        return {**{f.name: getattr(self, f.name) for f in fields(self)},
                "precision_recipe": self.recipe, "precision_description": self.precision_description}
