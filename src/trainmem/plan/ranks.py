"""The per-rank peak of a parallel configuration.

:func:`per_rank_peak` calls ``estimate(model, step, impl, parallel=...)``, the estimator's own
per-rank accounting. :func:`stage_peaks` is the first-order closed form of
:mod:`trainmem.plan.shard` on one single-device estimate, for the planner's inner loop (which
needs microseconds).
"""

from __future__ import annotations

from trainmem.estimate import estimate
from trainmem.plan.shard import StagePeak, breakdown, rank_peak
from trainmem.specs import ImplSpec, ModelSpec, ParallelSpec, StepSpec

__all__ = ["per_rank_peak", "stage_peaks"]


def _accumulates(step: StepSpec, parallel: ParallelSpec) -> bool:
    return step.grad_accum > 1 or parallel.microbatches > 1


def stage_peaks(model: ModelSpec, step: StepSpec, impl: ImplSpec, parallel: ParallelSpec) -> list[StagePeak]:
    """First-order per-stage peaks (see :mod:`trainmem.plan.shard`)."""
    return rank_peak(breakdown(estimate(model, step, impl)), parallel, accumulate=_accumulates(step, parallel))


def per_rank_peak(model: ModelSpec, step: StepSpec, impl: ImplSpec, parallel: ParallelSpec,
                  finetune=None) -> int:
    """The largest peak over the ranks of ``parallel``, in bytes (``finetune``: a FinetuneSpec)."""
    if parallel.is_single:
        return estimate(model, step, impl, finetune=finetune).peak_bytes
    return estimate(model, step, impl, parallel=parallel, finetune=finetune).peak_bytes
