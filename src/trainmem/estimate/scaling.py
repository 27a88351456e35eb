"""Memory against sequence length and micro-batch, from the estimator: the points behind an
estimate's scaling panels (``trainmem estimate --plot``). Renderers draw them; they never run
the estimator themselves."""

from __future__ import annotations

from dataclasses import replace
from typing import Callable, Sequence

from trainmem.errors import SpecError

__all__ = ["scaling_points", "scaling_sweeps"]


def scaling_points(e, over: str, values: Sequence[int],
                   progress: Callable[[float, str], None] | None = None) -> dict:
    """A sweep-shaped dict (``trainmem.sweep/2`` points) from the estimator at each value of
    ``over`` (``seq`` or ``batch``), every other input as in the estimate ``e``: its parallel
    layout (per-rank peaks, as the estimate's own) and its fine-tuning."""
    from trainmem.estimate import estimate

    if over not in ("seq", "batch"):
        raise SpecError("over", over, "must be seq or batch")
    points = []
    for i, v in enumerate(values):
        par = None if e.parallel.is_single else e.parallel
        p = estimate(e.model, replace(e.step, **{over: int(v)}), e.impl, par, finetune=e.finetune)
        points.append({"value": int(v), "peak_bytes": p.peak_bytes, "totals_bytes": dict(p.totals_bytes)})
        if progress is not None:
            progress((i + 1) / len(values), f"{over}={v}")
    return {"schema": "trainmem.sweep/2", "over": over, "backend": "estimate", "points": points}


def scaling_sweeps(e, progress: Callable[[float, str], None] | None = None) -> dict[str, dict]:
    """``{"seq": sweep, "batch": sweep}`` around the estimate's own step: a quarter to twice its
    sequence (capped by learned positions) and half to twice its micro-batch."""
    s, b = e.step.seq, e.step.batch
    top = e.model.max_positions or 8 * s
    seqs = sorted({max(1, min(top, s * k // 4)) for k in range(1, 9)})
    batches = sorted({max(1, b * k // 2) for k in range(1, 5)} | {1})
    return {"seq": scaling_points(e, "seq", seqs, progress), "batch": scaling_points(e, "batch", batches, progress)}
