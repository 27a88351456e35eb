"""The per-rank peak of a parallel configuration, from the estimator when it models parallelism.

:func:`per_rank_peak` calls ``estimate(model, step, impl, parallel=...)`` when the estimator takes a
``parallel`` argument. Until then (and for the planner's inner loop, which needs microseconds) it
uses the first-order closed form of :mod:`trainmem.plan.shard` on one single-device estimate;
:func:`parallel_source` says which one is in use.
"""

from __future__ import annotations

import inspect
from functools import lru_cache

from trainmem.estimate import estimate
from trainmem.plan.shard import StagePeak, breakdown, rank_peak
from trainmem.specs import ImplSpec, ModelSpec, ParallelSpec, StepSpec

__all__ = ["per_rank_peak", "stage_peaks", "parallel_source"]


@lru_cache(maxsize=1)
def parallel_source() -> str:
    """``"estimator"`` when :func:`trainmem.estimate.estimate` accepts ``parallel``, else ``"first-order"``."""
    return "estimator" if "parallel" in inspect.signature(estimate).parameters else "first-order"


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
    if parallel_source() == "estimator":
        return estimate(model, step, impl, parallel=parallel, finetune=finetune).peak_bytes
    return max(s.peak_bytes for s in stage_peaks(model, step, impl, parallel))
