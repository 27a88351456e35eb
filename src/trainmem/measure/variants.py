"""The same batches under several settings, side by side: memory, speed and numerics.

``"attention=eager,sdpa;recompute=none,full"`` is the product of its axes (four variants here).
Axes: ``attention``, ``recompute``, ``precision`` and ``batch`` written ``BxA`` (micro-batch B,
A micro-batches accumulated: ``4x1,2x2`` keep 4 sequences per optimizer step). Every variant
gets the same initial weights and the same token ids (one seed), so the first step's loss and
gradient norm should agree; they are compared with the first variant's.

Known limitations: precision variants start from weights initialised in their own dtype
(the same random stream, rounded differently); variants with different sequences per
optimizer step see different batches and their numerics are not comparable (flagged).
"""

from __future__ import annotations

import itertools
import re
from dataclasses import dataclass, replace

from trainmem.errors import SpecError
from trainmem.specs import ImplSpec, StepSpec

__all__ = ["parse_variants", "run_variants", "Variant", "VariantRow", "VariantsResult", "AXES", "SCHEMA"]

SCHEMA = "trainmem.variants/2"
AXES = ("attention", "recompute", "precision", "batch")
_BATCH = re.compile(r"^(\d+)(?:x(\d+))?$")


@dataclass(frozen=True)
class Variant:
    label: str
    step: StepSpec
    impl: ImplSpec


def _apply(step: StepSpec, impl: ImplSpec, key: str, value: str) -> tuple[StepSpec, ImplSpec]:
    if key == "attention":
        return step, replace(impl, attention=value)
    if key == "recompute":
        return step, replace(impl, recompute=value)
    if key == "precision":
        return replace(step, precision=value), impl
    m = _BATCH.match(value)
    if not m:
        raise SpecError("variants", f"batch={value}", "write batch as BxA (micro-batch x accumulation), e.g. 4x1,2x2")
    return replace(step, batch=int(m.group(1)), grad_accum=int(m.group(2) or 1)), impl


def parse_variants(text: str, step: StepSpec, impl: ImplSpec) -> list[Variant]:
    """Variants of ``step``/``impl``, the product of the axes in ``text``, first value first."""
    axes: list[tuple[str, list[str]]] = []
    for part in filter(None, (p.strip() for p in text.split(";"))):
        key, sep, values = part.partition("=")
        key = key.strip()
        if not sep or key not in AXES:
            raise SpecError("variants", part, f"expected AXIS=v1,v2 with AXIS one of {', '.join(AXES)}")
        vals = [v.strip() for v in values.split(",") if v.strip()]
        if not vals:
            raise SpecError("variants", part, "no values")
        if any(k == key for k, _ in axes):
            raise SpecError("variants", part, f"axis {key!r} given twice")
        axes.append((key, vals))
    if not axes:
        raise SpecError("variants", text, "no axes; write e.g. 'attention=eager,sdpa;recompute=none,full'")
    out = []
    for combo in itertools.product(*(vals for _, vals in axes)):
        s, i = step, impl
        for (key, _), value in zip(axes, combo):
            s, i = _apply(s, i, key, value)  # specs validate every value
        out.append(Variant(" ".join(f"{k}={v}" for (k, _), v in zip(axes, combo)), s, i))
    return out


@dataclass(frozen=True)
class VariantRow:
    label: str
    peak_bytes: int | None
    peak_reserved_bytes: int | None
    tokens_per_s: float | None
    loss: float | None  # first step (identical weights across variants)
    grad_norm: float | None
    loss_diff: float | None  # vs the first variant
    grad_norm_rel_diff: float | None
    status: str = "ok"  # "ok", "out of memory", "different batch"
    speed_ratio: float | None = None  # tokens/s ÷ the first variant's

    def to_dict(self) -> dict:
        out = {k: getattr(self, k) for k in ("label", "peak_bytes", "peak_reserved_bytes", "tokens_per_s",
                                            "loss", "grad_norm", "loss_diff", "grad_norm_rel_diff", "status",
                                            "speed_ratio")}
        return out


@dataclass(frozen=True)
class VariantsResult:
    device: str
    rows: tuple[VariantRow, ...]

    def to_dict(self) -> dict:
        from trainmem.schemas import header  # the base step and impl: profile's CLI fills inputs
        return {**header("variants"), "device": self.device, "rows": [r.to_dict() for r in self.rows]}


def run_variants(source, variants: list[Variant], *, device=None, seed: int = 0, steps: int = 2,
                 warmup: int = 1) -> VariantsResult:
    """Profile each variant (memory released in between; an out-of-memory variant is a row)."""
    from trainmem.measure.profiling import OutOfMemory, profile_model
    from trainmem.measure.workload import resolve_device

    dev = resolve_device(device) if not hasattr(device, "type") else device
    rows: list[VariantRow] = []
    first = None
    for v in variants:
        try:
            r = profile_model(source, v.step, v.impl, device=dev, seed=seed, steps=steps, warmup=warmup,
                              modules=False)
        except OutOfMemory:
            rows.append(VariantRow(v.label, None, None, None, None, None, None, None, "out of memory"))
            continue
        rank = r.ranks[0]
        loss = rank.losses[0] if rank.losses else None
        gn = rank.first_grad_norm
        row = VariantRow(v.label, rank.peak_bytes, rank.peak_reserved_bytes, rank.tokens_per_s, loss, gn,
                         None, None)
        if first is None:
            row = replace(row, loss_diff=0.0 if loss is not None else None, grad_norm_rel_diff=0.0 if gn else None,
                          speed_ratio=1.0 if rank.tokens_per_s else None)
            first = (v, row)
        else:
            fv, fr = first
            if rank.tokens_per_s and fr.tokens_per_s:
                row = replace(row, speed_ratio=rank.tokens_per_s / fr.tokens_per_s)
            same = fv.step.batch * fv.step.grad_accum == v.step.batch * v.step.grad_accum and fv.step.seq == v.step.seq
            if not same:
                row = replace(row, status="different batch")
            elif loss is not None and fr.loss is not None:
                rel = abs(gn - fr.grad_norm) / fr.grad_norm if gn is not None and fr.grad_norm else None
                row = replace(row, loss_diff=loss - fr.loss, grad_norm_rel_diff=rel)
        rows.append(row)
    return VariantsResult(str(dev), tuple(rows))
