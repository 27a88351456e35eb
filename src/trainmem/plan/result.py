"""The planner's result: :class:`Candidate` (one configuration, its peak and step time) and
:class:`Plan` (the shortlist, the Pareto front, the rejections and the search's statistics), with
their JSON form (schema ``trainmem.plan/2``, :mod:`trainmem.schemas`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from trainmem.plan.hardware import GPU, Reserve
from trainmem.specs import ModelSpec, StepSpec

__all__ = ["Candidate", "Plan", "SCHEMA"]

SCHEMA = "trainmem.plan/2"


@dataclass(frozen=True)
class Candidate:
    """One configuration, its per-rank peak and estimated step time."""

    config: dict
    peak_bytes: int
    step_time_s: float
    tokens_per_s: float
    fits: bool
    peak_stage: str = ""
    peak_phase: str = ""
    time_parts: dict = field(default_factory=dict)
    peak_source: str = "first-order"
    reserved_bytes: int | None = None
    """The reserved peak (allocator model) the verdict compares; None where only screened."""
    fit_state: str | None = None
    """:data:`trainmem.fits.FIT_STATES` of the rechecked estimate (``fits`` is true only for
    ``fits``; ``fits_with_cache_flush`` runs only by flushing the allocator cache); None where only screened."""

    def to_dict(self) -> dict:
        return {"config": self.config, "peak_bytes": self.peak_bytes, "step_time_s": self.step_time_s,
                "tokens_per_s": self.tokens_per_s, "fits": self.fits, "peak_stage": self.peak_stage,
                "peak_phase": self.peak_phase, "time_parts": self.time_parts, "peak_source": self.peak_source,
                "peak_reserved_bytes": self.reserved_bytes, "memory_figure": "reserved",
                "fit_state": self.fit_state}


@dataclass(frozen=True)
class Plan:
    model: ModelSpec
    step: StepSpec
    gpu: GPU
    gpus: int
    global_batch: int
    reserve: Reserve
    usable_bytes: int
    candidates: tuple[Candidate, ...]
    pareto: tuple[Candidate, ...]
    rejected: tuple[tuple[dict, str], ...]
    stats: dict
    global_batch_note: str = ""
    """Where the global batch came from when the user gave none (``default_global_batch``)."""
    gpu_counts: tuple[dict, ...] = ()
    """``--gpus auto``: every count tried, in order (see :mod:`trainmem.plan.count`)."""

    def to_dict(self, *, rejected: bool = False) -> dict:
        from trainmem.schemas import header
        # impl and parallel are searched, so the header leaves them null; the search's own inputs follow
        out = header("plan", model=self.model, step=self.step, gpu=self.gpu)
        out["inputs"].update({"gpus": self.gpus, "global_batch": self.global_batch,
                              "global_batch_note": self.global_batch_note})
        out.update({
            "reserve": {**self.reserve.to_dict(), "usable_bytes": self.usable_bytes, "figure": "reserved"},
            "candidates": [c.to_dict() for c in self.candidates],
            "pareto": [c.to_dict() for c in self.pareto],
            "search": self.stats,
        })
        if self.gpu_counts:
            out["gpu_counts"] = list(self.gpu_counts)
        if rejected:
            out["rejected"] = [{"config": c, "reason": r} for c, r in self.rejected]
        return out
