"""The changes ``trainmem advise`` searches over: a registry of choices, each a small pure function.

A :class:`Config` is one point of the search (step, implementation, parallel layout, fine-tuning).
A :class:`Choice` names the spec fields it changes, whether it changes the training itself (adapters
on a frozen base instead of full weights) and yields its
variants on a configuration (``flash``; micro-batch 4 → 2 or 1; ZeRO 1, 2, 3 ...), or nothing where
it does not apply. Choices are applied in registry order, each at most once, so a combination is a
set. A choice whose spec field does not exist is not registered: adding a mechanism to the specs
and one entry here is all the search needs.

Known limitations:
  - Only mechanisms the estimator models are offered; ``--compile`` only where the compiled rules
    cover the family and combination (elsewhere the estimator refuses it and the search drops it),
    and its speed-up is not priced.
    Op-level recompute is offered under the hf profile without fine-tuning adapters only.
  - Selective recompute is never offered with a fused attention kernel: it is a no-op there
    (:func:`trainmem.estimate.notes.selective_recompute_noop`).
  - Precision: fp32 → a 16-bit recipe gains the bf16 matmul rate, which the cost model does not
    price (every precision runs at the bf16 rate there): 0% on one device, labelled unpriced.
    fp16 recipes are not offered (loss scaling is not modelled); megatron-bf16 is not a target.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from functools import lru_cache
from typing import Callable, Iterator

from trainmem.estimate.notes import selective_recompute_noop
from trainmem.families import family_attentions
from trainmem.specs import ImplSpec, ModelSpec, ParallelSpec, StepSpec
from trainmem.specs.finetune import FinetuneSpec

__all__ = ["Config", "Choice", "CHOICES", "Context", "tp_degrees", "fused_attention"]


@dataclass(frozen=True)
class Config:
    """One configuration the search visits."""

    step: StepSpec
    impl: ImplSpec
    par: ParallelSpec
    finetune: FinetuneSpec | None = None

    def config(self) -> dict:
        p, s, i = self.par, self.step, self.impl
        out = {"micro_batch": s.batch, "grad_accum": s.grad_accum, "seq": s.seq, "precision": s.precision,
               "attention": i.attention,
               "recompute": i.recompute, "recompute_every": i.recompute_every, "loss": s.loss,
               "optimizer": s.optimizer, "dp": p.dp, "tp": p.tp, "sp": p.sp, "zero": p.zero, "fsdp": p.fsdp,
               "offload": list(p.offload), "finetune": None if self.finetune is None else self.finetune.mode}
        for name in _OPTIONAL_IMPL:
            out[name] = getattr(i, name)
        return out

    def command(self, model: str) -> str:
        """The ``trainmem estimate`` line that reproduces this configuration's per-rank peak."""
        s, i, p = self.step, self.impl, self.par
        parts = ["trainmem estimate", f"--model {model}", f"--batch {s.batch}", f"--seq {s.seq}"]
        if s.grad_accum != 1:
            parts.append(f"--grad-accum {s.grad_accum}")
        parts += [f"--precision {s.precision}", f"--optimizer {s.optimizer}", f"--loss {s.loss}",
                  f"--attention {i.attention}", f"--recompute {i.recompute}"]
        if i.recompute == "every-k":
            parts.append(f"--recompute-every {i.recompute_every}")
            if i.recompute_from != "kth":  # transformers' every_n_layers count (--hf-args), not torchtitan's
                parts.append(f"--recompute-from {i.recompute_from}")
        if i.profile != "hf":
            parts.append(f"--profile {i.profile}")
        if i.device != "cuda":
            parts.append(f"--device {i.device}")
        if getattr(i, "optimizer_impl", "auto") != "auto":
            parts.append(f"--optimizer-impl {i.optimizer_impl}")
        if getattr(i, "optimizer_in_backward", False):
            parts.append("--optimizer-in-backward")
        if getattr(i, "compile", False):
            parts.append("--compile" + (f" --compile-scope {i.compile_scope}"
                                        if getattr(i, "compile_scope", "model") != "model" else ""))
        if getattr(i, "float8", "none") != "none":
            parts.append(f"--float8 {i.float8}" + (" --float8-all-gather" if i.float8_all_gather else ""))
        if not p.is_single:
            parts.append(f"--dp {p.dp}")
            if p.tp > 1:
                parts.append(f"--tp {p.tp}" + (" --sp" if p.sp else "")
                             + ("" if getattr(p, "loss_parallel", True) else " --no-loss-parallel"))
            for name in ("cp", "ep", "pp"):
                if getattr(p, name) > 1:
                    parts.append(f"--{name} {getattr(p, name)}")
            if p.zero:
                parts.append(f"--zero {p.zero}")
            if p.fsdp:
                parts.append(f"--fsdp {p.fsdp}" + (" --fsdp-version 1" if p.fsdp_version == 1 else ""))
            if p.offload:
                parts.append(f"--offload {','.join(p.offload)}")
        f = self.finetune
        if f is not None:
            parts.append(f"--finetune {f.mode}")
            if f.adapters:
                parts.append(f"--lora-rank {f.lora_rank}")
                if f.lora_targets is not None:  # None: the family's default, no flag
                    parts.append(f"--lora-targets {','.join(f.lora_targets)}")
            if f.freeze:
                parts.append(f"--freeze {','.join(f.freeze)}")
            # the adapter and 4-bit settings that change memory (docs/finetune.md), so the line reproduces the peak
            if f.adapters and f.lora_dropout:
                parts.append(f"--lora-dropout {f.lora_dropout}")
            if f.adapters and f.adapter_dtype != "float32":
                parts.append(f"--adapter-dtype {f.adapter_dtype}")
            if f.mode == "qlora":
                parts += ([f"--qlora-scope {f.qlora_scope}"] if f.qlora_scope != "all" else []) + \
                         (["--no-double-quant"] if not f.double_quant else []) + \
                         (["--quantize-head"] if f.quantize_head else []) + \
                         ([f"--quant-impl {f.quant_impl}"] if f.quant_impl != "bnb" else [])
        return " ".join(parts)


@dataclass(frozen=True)
class Context:
    """What the variants of a choice may depend on besides the configuration."""

    model: ModelSpec
    gpus: int
    gpus_per_node: int
    fp8: bool = False
    """The GPU preset states an FP8 rate (H100, H200, B200): Float8 training is offered."""


Variants = Callable[[Config, Context], Iterator[tuple[Config, str]]]


@dataclass(frozen=True)
class Choice:
    name: str
    fields: tuple[str, ...]
    """Spec fields it changes (``spec.field``)."""
    changes_training: bool
    """Whether it is a different training run (adapters on a frozen base), not the same step laid
    out in memory another way. Such options are ranked after those that keep the training."""
    variants: Variants
    note: str = ""


CHOICES: dict[str, Choice] = {}

_SPECS = {"step": StepSpec, "impl": ImplSpec, "parallel": ParallelSpec, "finetune": FinetuneSpec}
_OPTIONAL_IMPL = tuple(n for n in ("optimizer_impl", "optimizer_in_backward", "compile", "compile_scope", "float8",
                                    "float8_all_gather")
                       if n in {f.name for f in fields(ImplSpec)})


def _exists(path: str) -> bool:
    spec, name = path.split(".")
    return name in {f.name for f in fields(_SPECS[spec])}


def choice(name: str, fields_changed: tuple[str, ...], *, changes_training: bool = False, note: str = ""):
    """Register a choice's variant generator; refuses duplicates, skips choices whose spec fields
    do not exist."""
    def register(fn: Variants) -> Variants:
        if name in CHOICES:
            raise ValueError(f"choice {name!r} registered twice")
        if all(_exists(f) for f in fields_changed):
            CHOICES[name] = Choice(name, fields_changed, changes_training, fn, note)
        return fn
    return register


def fused_attention(step: StepSpec, impl: ImplSpec) -> str:
    """The fused kernel that replaces eager/math attention: flash for 16-bit activations on CUDA,
    else the memory-efficient kernel."""
    return "flash" if impl.device == "cuda" and step.dtypes.activation in ("bfloat16", "float16") else "mem-efficient"


@lru_cache(maxsize=256)
def _selective_noop(model: ModelSpec, step: StepSpec, impl: ImplSpec) -> str | None:
    """:func:`selective_recompute_noop`, once per (model, step, impl): it builds the activation
    inventory, and the search asks it for every combination that reaches the recompute choice
    (625 asks, one distinct question, 2.5 s for a 405B start before this cache)."""
    return selective_recompute_noop(model, step, impl)


def tp_degrees(model: ModelSpec, seq: int, gpus: int, gpus_per_node: int) -> list[int]:
    """Tensor-parallel degrees inside one node that divide the GPUs, heads, FFN and sequence (SP)."""
    return [t for t in (2, 4, 8, 16) if t <= min(gpus, gpus_per_node) and gpus % t == 0
            and model.num_heads % t == 0 and model.ffn_size % t == 0 and seq % t == 0]


# The registry, in the order a combination is applied ------------------------------------------

@choice("attention", ("impl.attention",), note="exact attention; no S×S matrix is saved")
def _attention(c: Config, ctx: Context):
    if c.impl.attention in ("eager", "sdpa-math"):
        k = fused_attention(c.step, c.impl)
        if k in family_attentions(ctx.model.family):  # gpt-oss: eager only
            yield replace(c, impl=replace(c.impl, attention=k)), f"attention {c.impl.attention} → {k}"


@choice("micro_batch", ("step.batch", "step.grad_accum"), note="same sequences per optimizer step")
def _micro_batch(c: Config, ctx: Context):
    b, a = c.step.batch, c.step.grad_accum
    for d in range(b - 1, 0, -1):
        if b % d == 0:
            yield (replace(c, step=replace(c.step, batch=d, grad_accum=a * (b // d))),
                   f"micro-batch {b} → {d}, gradient accumulation {a} → {a * (b // d)}")


@choice("recompute", ("impl.recompute", "impl.recompute_every"), note="recompute in backward")
def _recompute(c: Config, ctx: Context):
    now = c.impl.recompute
    if now == "full":
        return
    if now == "none" and not _selective_noop(ctx.model, c.step, c.impl):
        yield replace(c, impl=replace(c.impl, recompute="selective", recompute_every=1)), "selective recompute"
    if now in ("none", "selective"):
        for k in (4, 2):
            if k < ctx.model.num_layers:
                yield (replace(c, impl=replace(c.impl, recompute="every-k", recompute_every=k)),
                       f"checkpoint every {'2nd' if k == 2 else f'{k}th'} block")
    if now in ("none", "selective") and c.impl.profile == "hf" and c.finetune is None:
        yield (replace(c, impl=replace(c.impl, recompute="op", recompute_every=1)),
               "op-level checkpointing (torchtitan's policy: keep every other matmul output)")
    yield replace(c, impl=replace(c.impl, recompute="full", recompute_every=1)), "full activation checkpointing"


@choice("loss", ("step.loss",), note="the same loss without the full fp32 logits")
def _loss(c: Config, ctx: Context):
    order = ("ce", "chunked-ce", "fused-ce")
    if c.step.loss not in order:  # torchtune's / LitGPT's own loss: the framework's, not a knob here
        return
    for loss in order[order.index(c.step.loss) + 1:]:
        yield replace(c, step=replace(c.step, loss=loss)), f"loss {c.step.loss} → {loss}"


@choice("optimizer_impl", ("impl.optimizer_impl",), note="torch's fused kernel: no parameter-sized temporary")
def _optimizer_impl(c: Config, ctx: Context):
    if c.impl.optimizer_impl != "fused" and c.step.optimizer in ("adamw", "adam", "sgd", "sgd-momentum"):
        yield replace(c, impl=replace(c.impl, optimizer_impl="fused")), "fused optimizer step"


@choice("optimizer_in_backward", ("impl.optimizer_in_backward",),
        note="each parameter steps in its gradient hook; needs gradient accumulation 1 and one device")
def _optimizer_in_backward(c: Config, ctx: Context):
    if not c.impl.optimizer_in_backward and c.step.grad_accum == 1 and c.par.is_single:
        yield replace(c, impl=replace(c.impl, optimizer_in_backward=True)), "optimizer step in backward"


@choice("float8", ("impl.float8", "impl.float8_all_gather", "impl.compile_scope", "parallel.sp"),
        note="torchao Float8 linears (docs/float8.md): fp8 matmuls at the GPU's FP8 rate; numerics differ from bf16")
def _float8(c: Config, ctx: Context):
    i = c.impl
    if not ctx.fp8 or i.float8 != "none" or i.profile != "hf" or c.finetune is not None:
        return
    # under --compile the Float8 rules are per block (torchtitan compiles each block around Float8Linear:
    # docs/float8.md, estimate/rules_compiled.py); a whole-model compile becomes a per-block one
    if i.compile and i.compile_scope == "model":
        i = replace(i, compile_scope="block")
    where = " (compiled per block)" if i.compile and c.impl.compile_scope == "model" else ""
    # under TP, torchao's tensorwise Float8 TP styles need sequence parallelism (torchtitan's plan,
    # estimate/float8.py _tp_fp8_input); rowwise takes the plain TP styles. Precision and recompute
    # limits are the estimator's: a variant it refuses is never an option (advise's _Measure).
    # TP without SP: tensorwise comes as one change with SP turned on (torchtitan's
    # enable_float8_tensorwise_tp takes the SP plan); memory and speed are the new configuration's,
    # priced as the Float8 and SP choices are (plan/cost.py: TP traffic is the same volume with SP).
    par, also = c.par, ""
    if c.par.tp > 1 and not c.par.sp:
        par, also = replace(c.par, sp=True), " with sequence parallelism"
    tw = replace(i, float8="tensorwise", float8_all_gather=True) if c.par.fsdp else replace(i, float8="tensorwise")
    yield (replace(c, impl=tw, par=par),
           "Float8 linears, tensorwise" + (", fp8 all-gather" if c.par.fsdp else "") + also + where)
    yield replace(c, impl=replace(i, float8="rowwise")), "Float8 linears, rowwise" + where


@choice("compile", ("impl.compile",),
        note="torch.compile: inductor's min-cut partition saves less for backward (docs/compile.md); "
             "its speed-up is not priced (the throughput cost model has no compile term)")
def _compile(c: Config, ctx: Context):
    # only where the estimator has compiled rules: a refused family or combination fails in the search
    # (advise's _Measure keeps it out), never a silent eager number
    if c.impl.compile or c.impl.profile != "hf":
        return
    if c.impl.float8 == "none":
        yield replace(c, impl=replace(c.impl, compile=True)), "torch.compile"
    else:  # Float8 is modelled compiled per block (docs/float8.md "With --compile"), as torchtitan compiles it
        yield replace(c, impl=replace(c.impl, compile=True, compile_scope="block")), "torch.compile per block"


#: low-bit optimizers offered for AdamW / Adam (docs/optimizers.md): bitsandbytes' 8-bit, its paged
#: 8-bit (states in unified memory, outside the allocated peak, priced as paged over PCIe each step:
#: plan/cost.py), torchao's 8-bit and 4-bit
_LOW_BIT = {"adamw": ("adamw8bit", "paged-adamw8bit", "torchao-adamw8bit", "torchao-adamw4bit"),
            "adam": ("adam8bit",)}


@choice("optimizer_8bit", ("step.optimizer",),
        note="block-quantized optimizer states (bitsandbytes 8-bit, paged 8-bit, torchao 8/4-bit): close to "
             "Adam, not bit-identical; paged states leave the allocated peak but cross PCIe under pressure")
def _optimizer_8bit(c: Config, ctx: Context):
    for low in _LOW_BIT.get(c.step.optimizer, ()):
        yield replace(c, step=replace(c.step, optimizer=low)), f"optimizer {c.step.optimizer} → {low}"


@choice("shard", ("parallel.zero", "parallel.fsdp"), note="shards model states over the data-parallel ranks")
def _shard(c: Config, ctx: Context):
    p = c.par
    if p.dp == 1 or p.fsdp is not None:
        return
    for z in (1, 2, 3):
        if z > p.zero:
            yield replace(c, par=replace(p, zero=z)), f"ZeRO stage {z} over {p.dp} ranks"
    yield replace(c, par=replace(p, zero=0, fsdp="full")), f"FSDP (full shard) over {p.dp} ranks"


@choice("tensor_parallel", ("parallel.tp", "parallel.sp"),
        note="heads and FFN split over the TP group, norms and residuals over tokens (SP)")
def _tensor_parallel(c: Config, ctx: Context):
    p = c.par
    if p.tp > 1 or ctx.gpus == 1:
        return
    for t in tp_degrees(ctx.model, c.step.seq, p.dp, ctx.gpus_per_node):
        yield (replace(c, par=replace(p, tp=t, sp=True, dp=p.dp // t),
                       step=replace(c.step, grad_accum=c.step.grad_accum * t)),
               f"TP{t} with SP (data parallel {p.dp} → {p.dp // t}, accumulation ×{t})")


@choice("loss_parallel", ("parallel.loss_parallel",),
        note="TP: logits and cross-entropy stay vocab-sharded (torch's loss_parallel, estimate/loss_parallel.py): "
             "V/tp per rank instead of the gathered B·S·V logits, and no all-gather of them")
def _loss_parallel(c: Config, ctx: Context):
    if c.par.tp > 1 and not c.par.loss_parallel and c.step.loss == "ce" and c.impl.profile != "megatron":
        yield replace(c, par=replace(c.par, loss_parallel=True)), f"loss_parallel over TP{c.par.tp}"


#: recipes that keep fp32 optimizer states and 16-bit activations, offered from an fp32 start; fsdp-bf16
#: (FSDP2's MixedPrecisionPolicy, specs/step.py) only where FSDP2 shards the model
_MIXED = {"amp-bf16": "autocast: fp32 weights, gradients and states, bf16 activations",
          "mixed-bf16": "bf16 weights and gradients, fp32 master weights and states",
          "fsdp-bf16": "FSDP2 MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32): fp32 shards and states, "
                       "bf16 gathered weights and activations"}
#: the cost model (plan/cost.py step_time) runs every matmul at the GPU's bf16 rate, whatever the precision
_UNPRICED_MATMULS = "the bf16 matmul speed-up is unpriced: the cost model runs every precision at the bf16 rate"
_UNPRICED = "bf16 matmul speed-up unpriced"


@choice("precision", ("step.precision",),
        note="16-bit activations and compute weights, fp32 optimizer states (docs/plan.md 'Precision'); "
             + _UNPRICED_MATMULS)
def _precision(c: Config, ctx: Context):
    if c.step.recipe != "fp32" or c.impl.profile == "megatron":
        return
    for recipe, what in _MIXED.items():
        if recipe == "fsdp-bf16" and not (c.par.fsdp and c.par.fsdp_version == 2):
            continue  # the estimator refuses it without FSDP2 (estimate/__init__.py; torchtitan autocasts there)
        yield (replace(c, step=replace(c.step, precision=recipe)),
               f"precision fp32 → {recipe} ({what}; {_UNPRICED})")


@choice("pure_bf16", ("step.precision",),
        note="pure bf16: no fp32 copy anywhere; AdamW's bf16 states and updates lose precision (small updates "
             "round away), which changes the numerics of training")
def _pure_bf16(c: Config, ctx: Context):
    if c.step.recipe not in ("fp32", "amp-bf16", "mixed-bf16", "fsdp-bf16") or c.impl.profile == "megatron":
        return
    yield (replace(c, step=replace(c.step, precision="bf16")),
           f"precision {c.step.precision} → pure bf16 (caveat: bf16 AdamW states and weights lose precision, small "
           f"updates round away" + (f"; {_UNPRICED})" if c.step.recipe == "fp32" else ")"))


@choice("offload_optimizer", ("parallel.offload",), note="optimizer step on the CPU; PCIe traffic every step")
def _offload_optimizer(c: Config, ctx: Context):
    if "optimizer" not in c.par.offload and not (c.step.optimizer == "sgd" and not c.step.dtypes.master):
        yield (replace(c, par=replace(c.par, offload=c.par.offload + ("optimizer",), zero=max(c.par.zero, 1))),
               "offload optimizer states to CPU")


@choice("fsdp_cpu_offload", ("parallel.offload",),
        note="FSDP's CPUOffloadPolicy: sharded parameters, gradients and optimizer states in host memory, the "
             "optimizer step on the CPU; shards over PCIe every all-gather and reduce-scatter")
def _fsdp_cpu_offload(c: Config, ctx: Context):
    if c.par.fsdp and "params" not in c.par.offload:
        yield replace(c, par=replace(c.par, offload=c.par.offload + ("params",))), "FSDP CPU offload (CPUOffloadPolicy)"


@choice("offload_activations", ("parallel.offload",), note="saved activations to host memory and back")
def _offload_activations(c: Config, ctx: Context):
    if "activations" not in c.par.offload:
        yield replace(c, par=replace(c.par, offload=c.par.offload + ("activations",))), "offload activations to CPU"


@choice("qlora_storage", ("finetune.qlora_scope", "finetune.double_quant", "finetune.quantize_head"),
        note="QLoRA's 4-bit storage (docs/finetune.md): every frozen linear in 4 bits, not only the adapters' targets; "
             "double-quantized absmax constants; a 4-bit output head. Numerics differ; the step time is priced as before")
def _qlora_storage(c: Config, ctx: Context):
    f = c.finetune
    if f is None or f.mode != "qlora":
        return
    if f.qlora_scope == "targeted":
        yield replace(c, finetune=replace(f, qlora_scope="all")), "QLoRA: every frozen linear in 4 bits (scope all)"
    if not f.double_quant:
        yield replace(c, finetune=replace(f, double_quant=True)), "QLoRA: double quantization"
    if not f.quantize_head and not ctx.model.tied_embeddings:  # the estimator refuses a tied 4-bit head
        yield replace(c, finetune=replace(f, quantize_head=True)), "QLoRA: 4-bit output head"


@choice("finetune", ("finetune.mode",), changes_training=True,
        note="adapters on a frozen base: a different training run")
def _finetune(c: Config, ctx: Context):
    if c.finetune is None:
        for mode in ("lora", "qlora"):
            yield (replace(c, finetune=FinetuneSpec(mode=mode, lora_targets=("all-linear",), lora_rank=16)),
                   f"{'LoRA' if mode == 'lora' else 'QLoRA'} r=16 on all linear layers")
