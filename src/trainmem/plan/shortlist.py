"""The planner's shortlist: the screen's fitting rows, fastest first, rechecked by the estimator.

The closed form screens and ranks; every peak reported (table, front, JSON, HTML) is the
estimator's own per-rank peak of that configuration (``estimate(..., parallel=...)``), and a
configuration fits when its reserved peak (the allocator model's replay) is within the budget.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Callable

from trainmem.errors import TrainmemError
from trainmem.estimate import estimate
from trainmem.plan.axes import IMPL_FIELDS, STEP_FIELDS
from trainmem.plan.result import Candidate
from trainmem.plan.screen import config
from trainmem.specs import ImplSpec, ModelSpec, ParallelSpec, StepSpec

__all__ = ["MAX_FRONT", "shortlist", "recheck"]

MAX_FRONT = 12
"""Screened Pareto points checked by the estimator (evenly spaced when the screen finds more)."""


def _pareto(rows: list[tuple]) -> list[tuple]:
    """Rows (step time, StagePeak, ...) no other row beats on both peak and step time."""
    front: list[tuple] = []
    best_time = float("inf")
    for r in sorted(rows, key=lambda r: (r[1].peak_bytes, r[0])):
        if r[0] < best_time:
            front.append(r)
            best_time = r[0]
    return front


def shortlist(fitting: list[tuple], closest: list[tuple], *, top: int, front: bool, tokens: int, usable: int,
              check: Callable[[Candidate], Candidate], rejected: list[tuple[dict, str]]
              ) -> tuple[list[Candidate], list[Candidate], int]:
    """The ``top`` fastest rows of ``fitting`` that ``check`` (the estimator's recheck) still fits, or
    the ``top`` closest to fitting when none does; the Pareto front of the fitting ones (empty unless
    ``front``); and how many configurations were checked. Sorts ``fitting`` and appends to ``rejected``."""

    def candidate(row) -> Candidate:
        total, worst, mb, accum, attn, rc, p, t, v = row
        return Candidate(config(mb, accum, attn, rc, p, v), worst.peak_bytes, total, tokens / total,
                         worst.peak_bytes <= usable, worst.stage, worst.phase, t.to_dict())

    fitting.sort(key=lambda r: (r[0], r[1].peak_bytes))
    # The closed form screens and ranks; every peak reported (table, front, JSON, HTML) is the
    # estimator's own per-rank peak of that configuration (estimate(..., parallel=...)).
    checked: dict[tuple, Candidate] = {}

    def exact(row) -> Candidate:
        c = candidate(row)
        key = _key(c.config)
        if key not in checked:
            try:
                checked[key] = check(c)
            except TrainmemError as exc:  # an opt-in axis the estimator refuses here: never shown as fitting
                checked[key] = replace(c, fits=False, peak_source="refused")
                rejected.append((c.config, f"the estimator refuses it: {exc}"))
        return checked[key]

    if fitting:
        # walk down the ranking until ``top`` configurations fit by the estimator too (bounded)
        shown = []
        for r in fitting[: 8 * top]:
            c = exact(r)
            if c.fits:
                shown.append(c)
                if len(shown) == top:
                    break
            elif c.peak_source != "refused":
                flush = "; fits only by flushing the allocator cache (slower)" \
                    if c.fit_state == "fits_with_cache_flush" else ""
                rejected.append((c.config, f"per-rank estimate {c.reserved_bytes} B reserved ({c.peak_bytes} B "
                                           f"allocated) > usable {usable} B (the closed-form screen said it fits)"
                                           + flush))
        if not shown:
            shown = [exact(r) for r in fitting[:top]]
    else:
        shown = [exact(r) for r in sorted(closest, key=lambda r: r[1].peak_bytes)[:top]]
    screened = _pareto(fitting) if front else []
    if len(screened) > MAX_FRONT:  # evenly spaced, both ends kept
        screened = [screened[round(i * (len(screened) - 1) / (MAX_FRONT - 1))] for i in range(MAX_FRONT)]
    pareto = _front([exact(r) for r in screened] + [c for c in shown if c.fits]) if front else []
    return shown, pareto, len(checked)


def _key(cfg: dict) -> tuple:
    return tuple((k, tuple(v) if isinstance(v, list) else v) for k, v in sorted(cfg.items()))


def _front(cands: list[Candidate]) -> list[Candidate]:
    """The fitting candidates no other beats on both per-rank peak and step time, by peak."""
    out: list[Candidate] = []
    best_time = float("inf")
    seen = set()
    for c in sorted((c for c in cands if c.fits), key=lambda c: (c.peak_bytes, c.step_time_s)):
        k = _key(c.config)
        if c.step_time_s < best_time and k not in seen:
            out.append(c)
            seen.add(k)
            best_time = c.step_time_s
    return out


def recheck(model: ModelSpec, base: StepSpec, profile: str, c: Candidate, usable: int,
            finetune=None) -> Candidate:
    """The configuration through the estimator's own per-rank accounting (``estimate(..., parallel=...)``):
    its peak, and the rank class and phase where it occurs; it fits when its reserved peak
    (:func:`~trainmem.estimate.allocation_order.estimate_reserved`, as ``estimate --memory-figure
    reserved`` states it) is within ``usable``."""
    from trainmem.estimate.allocation_order import estimate_fit_state, estimate_reserved

    cfg = c.config
    step = replace(base, batch=cfg["micro_batch"], grad_accum=cfg["grad_accum"],
                   **{k: cfg[k] for k in STEP_FIELDS if k in cfg})
    impl = ImplSpec(profile=profile, attention=cfg["attention"], recompute=cfg["recompute"],
                    **{k: cfg[k] for k in IMPL_FIELDS if k in cfg})
    par = ParallelSpec(dp=cfg["dp"], tp=cfg["tp"], sp=cfg["sp"], cp=cfg["cp"], pp=cfg["pp"],
                       microbatches=cfg["grad_accum"], zero=cfg["zero"], offload=tuple(cfg["offload"]))
    e = estimate(model, step, impl, parallel=None if par.is_single else par, finetune=finetune)
    worst = max(e.ranks, key=lambda r: r.peak_bytes) if e.ranks else e
    stage = worst.name if e.ranks else "rank"
    reserved = estimate_reserved(e).reserved_bytes
    state = estimate_fit_state(e, usable)[0]
    return replace(c, peak_bytes=e.peak_bytes, fits=state == "fits", peak_stage=stage,
                   peak_phase=worst.peak.name, peak_source="estimator", reserved_bytes=reserved, fit_state=state)
