"""``trainmem plan --search AXIS,...``: opt-in axes of the layout search, a registry.

The default search is attention × recompute × parallel layouts × optimizer offload
(:mod:`trainmem.plan.search`). An axis named here adds its values to it: ``compile``
(``torch.compile``), ``float8`` (torchao Float8 linears, tensorwise or rowwise), ``optimizer-impl``
(torch's ``foreach`` / ``fused`` AdamW kernels), ``optimizer-8bit`` (bitsandbytes' 8-bit, paged
8-bit, torchao's 8/4-bit AdamW), ``optimizer-in-backward`` (the step in the gradient hooks) and
``offload-activations`` (torchtune's ``OffloadActivations``). The product of the named axes'
values is a set of :class:`Variant` s; each is one more saved set for the screen (two estimator
calls, at micro-batch 1 and 2) and every layout is tried with it.

Each axis says where the estimator refuses it, so a refused combination is skipped with the
reason (``--rejected`` lists it) instead of failing the search:

* a variant the estimator refuses outright (compile on a family without compiled rules, Float8
  with fine-tuning adapters, ...) is skipped once, with the estimator's own message;
* a layout it refuses is checked per layout with the estimator's own validation
  (:func:`trainmem.estimate.parallel.validate`: Float8 under TP needs a pure precision, tensorwise
  needs SP and recompute none/full) and the axes' one-device limits below;
* anything the estimator still refuses at the recheck is rejected there with its message.

Known limitations:
  - ``optimizer-in-backward`` and ``offload-activations`` are modelled on one device only (the
    estimator refuses them under any parallel layout), so they add candidates only to
    ``--gpus 1`` plans; the screen takes their estimator peaks per micro-batch (the closed form of
    :mod:`trainmem.plan.shard` does not rebuild their phases).
  - ``compile`` is modelled on one device's shapes: no TP, SP or CP (``estimate/rules_compiled.py``
    ``check_compiled``); its speed-up is not priced (the cost model has no compile term).
  - ``float8`` needs a GPU preset with an FP8 rate; its fp8 casts are not priced.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from itertools import product
from typing import Callable

from trainmem.errors import TrainmemError
from trainmem.estimate import estimate
from trainmem.estimate.notes import selective_recompute_noop
from trainmem.plan.shard import Breakdown, breakdown
from trainmem.specs import ImplSpec, ParallelSpec, StepSpec
from trainmem.specs.optimizer_impl import IMPLEMENTATIONS, optimizer_impl_used

__all__ = ["Axis", "AXES", "Variant", "Kernel", "variants", "saved_sets", "layout_refusal", "refusal",
           "IMPL_FIELDS", "STEP_FIELDS"]

#: fields a variant may set, by spec: what the recheck reads back out of a candidate's config
IMPL_FIELDS = ("compile", "compile_scope", "float8", "optimizer_impl", "optimizer_in_backward")
STEP_FIELDS = ("optimizer",)


@dataclass(frozen=True)
class Variant:
    """One point of the named axes: spec fields set on top of (attention, recompute)."""

    impl: tuple[tuple[str, object], ...] = ()
    step: tuple[tuple[str, object], ...] = ()
    offload_activations: bool = False
    one_device: bool = False
    """Modelled on one device only (the estimator refuses it under any parallel layout)."""

    def config(self) -> dict:
        """What a candidate's config shows for the named axes."""
        out = dict(self.impl) | dict(self.step)
        if any(k == "compile" for k, _ in self.impl):
            out.setdefault("compile_scope", "model")
        return out

    def describe(self) -> dict:
        """:meth:`config` with activation offload named (the search's saved sets, its refusals)."""
        return self.config() | ({"offload": ["activations"]} if self.offload_activations else {})


Values = Callable[[str], tuple[tuple[dict, dict, bool], ...]]


@dataclass(frozen=True)
class Axis:
    name: str
    values: Values
    """The axis's values for the plan's optimizer: (impl fields, step fields, offload activations),
    the first one the default (the search without the axis)."""
    note: str


AXES: dict[str, Axis] = {}


def axis(name: str, note: str):
    def register(fn: Values) -> Values:
        if name in AXES:
            raise ValueError(f"plan axis {name!r} registered twice")
        AXES[name] = Axis(name, fn, note)
        return fn
    return register


@axis("compile", "torch.compile (inductor's saved set, docs/compile.md); speed-up not priced")
def _compile(optimizer: str):
    return ({"compile": False}, {}, False), ({"compile": True}, {}, False)


@axis("float8", "torchao Float8 linears (docs/float8.md), priced at the GPU's FP8 rate")
def _float8(optimizer: str):
    return tuple(({"float8": f}, {}, False) for f in ("none", "tensorwise", "rowwise"))


@axis("optimizer-impl", "torch's optimizer kernels: foreach (torch's CUDA default, parameter-sized temporaries) "
                        "or fused")
def _optimizer_impl(optimizer: str):
    return tuple(({"optimizer_impl": k}, {}, False) for k in ("auto", "foreach", "fused"))


#: choices.py's low-bit optimizers, the same list advise offers
_LOW_BIT = {"adamw": ("adamw8bit", "paged-adamw8bit", "torchao-adamw8bit", "torchao-adamw4bit"),
            "adam": ("adam8bit",)}


@axis("optimizer-8bit", "block-quantized optimizer states (bitsandbytes, torchao), docs/optimizers.md")
def _optimizer_8bit(optimizer: str):
    return tuple(({}, {"optimizer": o}, False) for o in (optimizer,) + _LOW_BIT.get(optimizer, ()))


@axis("optimizer-in-backward", "the step in each parameter's gradient hook (one device, accumulation 1)")
def _in_backward(optimizer: str):
    return ({"optimizer_in_backward": False}, {}, False), ({"optimizer_in_backward": True}, {}, False)


@axis("offload-activations", "saved activations to pinned host memory and back (one device)")
def _offload_activations(optimizer: str):
    return ({}, {}, False), ({}, {}, True)


def variants(names: tuple[str, ...], optimizer: str) -> tuple[Variant, ...]:
    """Every combination of the named axes' values, the defaults first; ``()`` gives the one empty
    variant (the default search)."""
    out = []
    for combo in product(*(AXES[n].values(optimizer) for n in names)):
        impl: dict = {}
        step: dict = {}
        for i, s, _ in combo:
            impl.update(i)
            step.update(s)
        if impl.get("compile") and impl.get("float8", "none") != "none":
            impl["compile_scope"] = "block"  # compiled Float8 is modelled per block (docs/float8.md)
        one_device = bool(impl.get("optimizer_in_backward")) or any(o for *_, o in combo)
        out.append(Variant(tuple(impl.items()), tuple(step.items()), any(o for *_, o in combo), one_device))
    return tuple(out)


def layout_refusal(v: Variant, *, single: bool, accum: int, tp: int, sp: bool, cp: int) -> str | None:
    """Why the estimator refuses ``v`` on this layout (one that is not the estimator's own
    ``validate``), or None."""
    impl = dict(v.impl)
    if v.one_device and not single:
        what = "optimizer in backward" if impl.get("optimizer_in_backward") else "activation offload"
        return (f"{what} is modelled on one device only (estimate/__init__.py; estimate/activation_offload.py "
                "offloads_activations)")
    if impl.get("optimizer_in_backward") and accum > 1:
        return f"optimizer in backward needs gradient accumulation 1, not {accum} (specs/optimizer_impl.py)"
    if impl.get("compile") and (tp > 1 or sp or cp > 1):
        return (f"compile is modelled on one device's shapes, not tp={tp} sp={sp} cp={cp} "
                "(estimate/rules_compiled.py check_compiled)")
    return None


@dataclass(frozen=True)
class Kernel:
    """One saved set the screen scales: (attention, recompute, variant) at micro-batch 1 and 2."""

    variant: Variant
    impl: ImplSpec
    step: StepSpec
    """The plan's step at micro-batch 1 with the variant's fields (the optimizer)."""
    par: ParallelSpec | None
    """Activation offload's one-device layout (``--offload activations``), else None."""
    b1: Breakdown | None
    b2: Breakdown | None
    """The closed form's inputs; None for one-device variants (screened by :meth:`estimated`)."""
    host: tuple[int, int] = (0, 0)
    """Bytes sent to host per micro-batch at micro-batch 1 and 2 (activation offload)."""
    phases: dict = field(default_factory=dict, compare=False, hash=False)
    """One-device variants: per accumulation (False: 1, True: > 1), the estimator's phases at
    micro-batch 1 and 2, ``(names, bytes at 1, bytes at 2)``."""

    def host_bytes(self, mb: int) -> int:
        return self.host[0] + (self.host[1] - self.host[0]) * (mb - 1)

    def estimated(self, model, mb: int, accum: int, finetune) -> tuple[int, str]:
        """(peak, phase) at this micro-batch for one-device variants: each of the estimator's phases
        extrapolated from micro-batch 1 and 2 (their bytes are affine in it up to a few bytes of loss
        scalars: gpt2 S512, 48 B under the estimate at B=8; tests/plan/test_plan_axes.py), the largest."""
        acc = accum > 1
        if acc not in self.phases:
            es = [estimate(model, replace(self.step, batch=b, grad_accum=2), self.impl, self.par, finetune=finetune)
                  for b in (1, 2)]
            self.phases[acc] = _phase_table(*es)
        names, one, two = self.phases[acc]
        peak, name = max((a + (b - a) * (mb - 1), n) for n, a, b in zip(names, one, two))
        return peak, name


def _phase_table(e1, e2) -> tuple[tuple[str, ...], tuple[int, ...], tuple[int, ...]]:
    return (tuple(p.name for p in e1.phases), tuple(p.bytes for p in e1.phases), tuple(p.bytes for p in e2.phases))


def _duplicate(step: StepSpec, impl: ImplSpec) -> bool:
    """An explicit optimizer kernel that is the one ``auto`` runs (the same configuration), or one the
    optimizer does not have (bitsandbytes and torchao have one: the optimizer-8bit axis's own)."""
    return impl.optimizer_impl != "auto" and (
        impl.optimizer_impl not in IMPLEMENTATIONS[step.optimizer]
        or optimizer_impl_used(step, replace(impl, optimizer_impl="auto")) == impl.optimizer_impl)


def variant_refusal(v: Variant, *, gpus: int, fp8: bool) -> str | None:
    """Why a variant can give no candidate on ``gpus`` GPUs of this kind, before any estimate."""
    if v.one_device and gpus > 1:
        what = "optimizer in backward" if dict(v.impl).get("optimizer_in_backward") else "activation offload"
        return f"{what} is modelled on one device only, and the plan has {gpus} GPUs"
    if dict(v.impl).get("float8", "none") != "none" and not fp8:
        return "the GPU preset states no FP8 rate: Float8 would run no faster (as advise offers it)"
    return None


def saved_sets(model, base: StepSpec, profile: str, attentions: tuple[str, ...], recomputes: tuple[str, ...],
               axes: tuple[str, ...], finetune=None, *, gpus: int = 1, fp8: bool = False):
    """``(kernels, calls, noops, skipped)``: a :class:`Kernel` per distinct (attention, recompute,
    variant) saved set (attention kernels with the same set merged), the estimator calls made, the
    selective-recompute no-ops per attention, and the variants refused with the reason (the estimator's
    message, or :func:`variant_refusal`'s: one-device variants on several GPUs, Float8 without an FP8 rate)."""
    kernels: dict[tuple, Kernel] = {}
    seen: set = set()
    noops: dict[str, str] = {}
    skipped: list[dict] = []
    calls = 0
    for v in variants(axes, base.optimizer):
        step = replace(base, **dict(v.step))
        par = ParallelSpec(offload=("activations",)) if v.offload_activations else None
        why = variant_refusal(v, gpus=gpus, fp8=fp8)
        if why:
            skipped.append({**v.describe(), "why": why})
            continue
        for rc in recomputes:
            for attn in attentions:
                impl = ImplSpec(profile=profile, attention=attn, recompute=rc, **dict(v.impl))
                if _duplicate(step, impl):
                    continue
                try:
                    if rc == "selective" and "none" in recomputes:
                        why = selective_recompute_noop(model, step, impl)
                        if why:  # the same configuration as recompute=none, one attention forward slower
                            noops[attn] = why
                            continue
                    e1 = estimate(model, step, impl, par, finetune=finetune)
                except TrainmemError as exc:  # the estimator refuses this variant: skipped with its reason
                    skipped.append({"attention": attn, "recompute": rc, **v.describe(), "why": str(exc)})
                    continue
                calls += 1
                # one-device variants are screened with the estimator's own peaks (Kernel.estimated):
                # the closed form has no phases for them (in backward there is no optimizer phase)
                b1 = None if v.one_device else breakdown(e1)
                sig = (rc, v, b1 or (e1.peak_bytes, tuple(sorted(e1.totals_bytes.items()))))
                if sig in seen:  # same saved set as a kernel already listed
                    continue
                seen.add(sig)
                e2 = estimate(model, replace(step, batch=2), impl, par, finetune=finetune)
                calls += 1
                host = (e1.host.total(), e2.host.total()) if e1.host is not None else (0, 0)
                kernels[(attn, rc, v)] = Kernel(v, impl, step, par, b1, None if v.one_device else breakdown(e2), host,
                                                {False: _phase_table(e1, e2)} if v.one_device else {})
    return kernels, calls, noops, skipped


def refusal(model, kern: Kernel, p, single: bool) -> str | None:
    """Why the estimator refuses the kernel's variant on layout ``p`` (the planner's record, with
    ``spec()``): the one-device, accumulation and compile limits, then Float8 under TP through the
    estimator's own validation (:func:`trainmem.estimate.parallel.validate`)."""
    why = layout_refusal(kern.variant, single=single, accum=p.microbatches, tp=p.tp, sp=p.sp, cp=p.cp)
    if why or kern.impl.float8 == "none" or p.tp == 1:
        return why
    from trainmem.estimate.parallel import validate
    try:
        validate(model, kern.step, kern.impl, p.spec())
    except TrainmemError as exc:
        return str(exc)
    return None
