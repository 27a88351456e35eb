"""``trainmem plan``: search micro-batch × accumulation, attention, recompute, TP/SP/CP/PP/DP,
ZeRO/FSDP and offload for the fastest configurations that fit.

How it stays fast: the estimator is called twice per distinct (attention, recompute) pair, at
micro-batch 1 and 2 (attention kernels whose saved sets coincide are merged). Every activation term
is affine in the micro-batch, so those two :class:`~trainmem.plan.shard.Breakdown` s give any
micro-batch exactly, and :func:`~trainmem.plan.shard.rank_peak` spreads it over the parallel degrees
in closed form. Micro-batches are tried smallest first and a branch stops at the first that does not
fit (the peak grows with the micro-batch). Two choices the cost model can never prefer are skipped
with their reason: TP without sequence parallelism, and data parallelism without ZeRO-1. The shortlist shown is re-checked with
:func:`~trainmem.plan.ranks.per_rank_peak`, which uses the estimator's own parallel accounting when
it has one.

What "fits" means (the same as ``estimate --memory-figure reserved``): the rechecked configuration's
reserved peak, its estimate replayed through the caching-allocator model
(:func:`trainmem.estimate.allocation_order.estimate_reserved`, 0.07-0.12 s per configuration), is at
most capacity − context − NCCL buffers (more than one rank) − ``--reserve-fraction`` × capacity
(:meth:`~trainmem.plan.hardware.Reserve.reserved_usable_bytes`). The screen cannot replay each of
its thousands of configurations; it compares the closed-form allocated peak with the same budget,
a necessary condition (the replay's reserve is never negative: reserved ≥ allocated), so the screen
drops no configuration the model would fit and the recheck drops those the reserve pushes over.

Known limitations:
  - Schedules other than 1F1B, interleaving, hybrid FSDP and expert parallelism are not searched;
    TP stays inside a node. Compile, Float8, optimizer variants and activation offload are searched
    only when named (``SearchSpace.axes``, :mod:`trainmem.plan.axes`).
  - Step times are a first-order model (:mod:`trainmem.plan.cost`) for ranking, not prediction.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace

from trainmem.errors import SpecError, TrainmemError
from trainmem.estimate import estimate
from trainmem.families import family_attentions
from trainmem.plan.axes import IMPL_FIELDS, STEP_FIELDS, Variant, refusal, saved_sets
from trainmem.plan.cost import CostModel, matmul_parameters, step_time
from trainmem.plan.hardware import GPU, Reserve
from trainmem.plan.shard import Breakdown, StagePeak, rank_peak
from trainmem.specs import ImplSpec, ModelSpec, ParallelSpec, StepSpec

__all__ = ["SearchSpace", "Candidate", "Plan", "plan", "SCHEMA"]

SCHEMA = "trainmem.plan/2"
# Dominated choices, skipped when the choice that dominates them is in the search space:
_NO_SP = ("dominated by sp=True: the same bytes move (all-gather + reduce-scatter = all-reduce) "
          "and norms, dropout and residuals are split over the TP group")
_NO_ZERO = ("dominated by zero=1: the distributed optimizer moves the same bytes (reduce-scatter + "
            "all-gather = all-reduce) and holds 1/dp of the optimizer states")


@dataclass(frozen=True, kw_only=True)
class SearchSpace:
    """What the planner may choose. Degrees not dividing the GPU count are skipped."""

    attention: tuple[str, ...] = ("flash", "mem-efficient", "eager")
    recompute: tuple[str, ...] = ("none", "selective", "full")
    tp: tuple[int, ...] = (1, 2, 4, 8, 16)
    cp: tuple[int, ...] = (1, 2, 4, 8, 16)
    pp: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64)
    zero: tuple[int, ...] = (0, 1, 2, 3)
    offload: tuple[tuple[str, ...], ...] = ((), ("optimizer",))
    sp: tuple[bool, ...] = (False, True)
    max_micro_batch: int = 64
    axes: tuple[str, ...] = ()
    """Opt-in axes searched as well (:data:`trainmem.plan.axes.AXES`: compile, float8, optimizer-impl,
    optimizer-8bit, optimizer-in-backward, offload-activations); each multiplies the saved sets."""

    def __post_init__(self) -> None:
        from trainmem.plan.axes import AXES
        for name in self.axes:
            if name not in AXES:
                raise SpecError("search", name, f"unknown axis (known: {', '.join(AXES)})")


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


class _P:
    """A ParallelSpec-shaped record without validation, for the inner loop."""

    __slots__ = ("dp", "tp", "sp", "cp", "pp", "microbatches", "zero", "fsdp", "fsdp_group", "offload",
                 "schedule", "virtual_stages", "layer_split")

    def __init__(self, dp, tp, sp, cp, pp, microbatches, zero, offload):
        self.dp, self.tp, self.sp, self.cp, self.pp = dp, tp, sp, cp, pp
        self.microbatches, self.zero, self.offload = microbatches, zero, offload
        self.fsdp, self.fsdp_group = None, 8
        self.schedule, self.virtual_stages, self.layer_split = "1f1b", 1, ()  # ParallelSpec's defaults

    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.cp * self.pp

    def spec(self) -> ParallelSpec:
        return ParallelSpec(dp=self.dp, tp=self.tp, sp=self.sp, cp=self.cp, pp=self.pp,
                            microbatches=self.microbatches, zero=self.zero, offload=self.offload)


def _config(mb, accum, attn, rc, p: _P, variant: Variant = Variant()) -> dict:
    return {"micro_batch": mb, "grad_accum": accum, "attention": attn, "recompute": rc, "dp": p.dp,
            "tp": p.tp, "sp": p.sp, "cp": p.cp, "pp": p.pp, "schedule": "1f1b", "zero": p.zero,
            "offload": list(p.offload), **variant.config()}


def _structural(model: ModelSpec, seq: int, gpu: GPU, tp: int, cp: int, pp: int) -> str | None:
    if tp > gpu.gpus_per_node:
        return f"tp={tp} spans nodes ({gpu.gpus_per_node} GPUs per node): TP all-reduces every block"
    if model.num_heads % tp or (model.num_kv_heads % tp and tp % model.num_kv_heads):
        return f"tp={tp} does not divide {model.num_heads} heads / {model.num_kv_heads} KV heads"
    if model.ffn_size % tp:
        return f"tp={tp} does not divide ffn_size={model.ffn_size}"
    if seq % (2 * cp) and cp > 1:
        return f"cp={cp}: seq={seq} is not a multiple of 2·cp (load-balanced causal ring)"
    if pp > model.num_layers:
        return f"pp={pp} exceeds {model.num_layers} layers"
    return None


def _divisors(n: int, limit: int) -> list[int]:
    return [d for d in range(1, min(n, limit) + 1) if n % d == 0]


def _pareto(rows: list[tuple]) -> list[tuple]:
    """Rows (step time, StagePeak, ...) no other row beats on both peak and step time."""
    front: list[tuple] = []
    best_time = float("inf")
    for r in sorted(rows, key=lambda r: (r[1].peak_bytes, r[0])):
        if r[0] < best_time:
            front.append(r)
            best_time = r[0]
    return front


def plan(model: ModelSpec, *, seq: int, global_batch: int, gpu: GPU, gpus: int,
         precision: str = "bf16", optimizer: str = "adamw", loss: str = "ce", profile: str = "hf",
         reserve: Reserve | None = None, cost: CostModel = CostModel(), space: SearchSpace = SearchSpace(),
         top: int = 5, keep_rejected: bool = False, finetune=None, front: bool = True) -> Plan:
    """Every configuration of ``gpus`` × ``gpu`` for ``global_batch`` sequences of ``seq`` tokens,
    the ``top`` fastest that fit, and the memory-vs-time Pareto front of those that fit.
    ``finetune`` (a FinetuneSpec): frozen weights / LoRA change states and saved tensors.
    ``front=False`` leaves the Pareto front empty (no estimator calls for it). ``reserve``: default
    the preset's context and no extra margin (:meth:`Reserve.modelled`); a configuration fits when its
    reserved peak is within ``reserve.reserved_usable_bytes(gpu, gpus)`` (the module docstring)."""
    t0 = time.perf_counter()
    for name, value in (("gpus", gpus), ("global_batch", global_batch), ("seq", seq), ("top", top)):
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise SpecError(name, value, "must be a positive integer")
    reserve = Reserve.modelled(gpu) if reserve is None else reserve
    usable = reserve.reserved_usable_bytes(gpu, gpus)
    if usable <= 0:
        raise SpecError("reserve", reserve.to_dict(), f"leaves nothing of {gpu.name}'s {gpu.memory_bytes} bytes")
    base = StepSpec(batch=1, seq=seq, precision=precision, optimizer=optimizer, loss=loss)
    n_params = matmul_parameters(model)

    # two estimator calls per distinct (attention, recompute, variant of the opt-in axes) saved set
    kernels_run = tuple(a for a in space.attention if a in family_attentions(model.family))
    if not kernels_run:  # gpt-oss runs eager only
        raise SpecError("attention", ",".join(space.attention), f"{model.family} runs only "
                        f"{', '.join(family_attentions(model.family))} attention")
    kernels, calls, noops, refused = saved_sets(model, base, profile, kernels_run, space.recompute, space.axes,
                                                finetune, gpus=gpus, fp8=gpu.fp8_flops is not None)

    rejected: list[tuple[dict, str]] = []
    fitting: list[tuple] = []  # (step time, StagePeak, mb, accum, attention, recompute, _P, StepTime, Variant)
    closest: list[tuple] = []
    evaluated = 0
    steps: dict[tuple, StepSpec] = {}
    scaled: dict[tuple, Breakdown] = {}
    refusals: dict[tuple, str | None] = {}  # (kernel, layout, accumulates): the axes' layout refusals, memoized

    def reject(cfg_fn, why: str) -> None:
        if keep_rejected:
            rejected.append((cfg_fn(), why))

    for pp in space.pp:
        for cp in space.cp:
            for tp in space.tp:
                if gpus % (tp * cp * pp):
                    continue
                dp = gpus // (tp * cp * pp)
                why = _structural(model, seq, gpu, tp, cp, pp)
                probe = _P(dp, tp, False, cp, pp, 1, 0, ())
                if why:
                    reject(lambda: _config(None, None, None, None, probe), why)
                    continue
                if global_batch % dp:
                    reject(lambda: _config(None, None, None, None, probe),
                           f"global batch {global_batch} is not divisible by dp={dp}")
                    continue
                per_rank = global_batch // dp
                mbs = [m for m in _divisors(per_rank, space.max_micro_batch)]
                for sp in space.sp:
                    if sp and tp == 1:
                        continue
                    if not sp and tp > 1 and True in space.sp:
                        reject(lambda: _config(None, None, None, None, _P(dp, tp, sp, cp, pp, 1, 0, ())), _NO_SP)
                        continue
                    for zero in space.zero:
                        if zero and dp * cp == 1:
                            continue  # nothing to shard over
                        if zero == 0 and dp * cp > 1 and 1 in space.zero:
                            reject(lambda: _config(None, None, None, None, _P(dp, tp, sp, cp, pp, 1, 0, ())), _NO_ZERO)
                            continue
                        for off in space.offload:
                            if off and zero == 0:
                                continue  # offload is a ZeRO feature (DeepSpeed ZeRO-Offload)
                            for (attn, rc, v), kern in kernels.items():
                                if cp > 1 and attn == "eager":
                                    reject(lambda: _config(None, None, attn, rc, probe, v),
                                           f"cp={cp} needs a fused attention kernel (ring attention), not eager")
                                    continue
                                off_v = off + ("activations",) if v.offload_activations else off
                                single = dp * tp * cp * pp == 1 and not zero and not off
                                plain = v == Variant()
                                for i, mb in enumerate(mbs):
                                    accum = per_rank // mb
                                    p = _P(dp, tp, sp, cp, pp, accum, zero, off_v)
                                    if not plain:
                                        rkey = (attn, rc, v, dp, tp, sp, cp, pp, zero, off, accum > 1)
                                        if rkey not in refusals:
                                            refusals[rkey] = refusal(model, kern, p, single)
                                        if refusals[rkey]:
                                            reject(lambda: _config(mb, accum, attn, rc, p, v), refusals[rkey])
                                            continue
                                    evaluated += 1
                                    if v.one_device:  # the closed form does not rebuild these phases
                                        peak, phase = kern.estimated(model, mb, accum, finetune)
                                        worst = StagePeak("rank", peak, phase, {}, 0)
                                    else:
                                        b = scaled.get((attn, rc, v, mb))
                                        if b is None:
                                            b = scaled[(attn, rc, v, mb)] = kern.b1.scaled(kern.b2, mb)
                                        stages = rank_peak(b, p, accumulate=accum > 1, detail=False)
                                        worst = max(stages, key=lambda s: s.peak_bytes)
                                    step = steps.get((mb, kern.step))
                                    if step is None:
                                        step = steps[(mb, kern.step)] = replace(kern.step, batch=mb, grad_accum=accum)
                                    t = step_time(model, step, kern.impl, p, gpu, global_batch=global_batch, cost=cost,
                                                  n_params=n_params, offloaded_activation_bytes=kern.host_bytes(mb))
                                    total = t.total_s
                                    row = (total, worst, mb, accum, attn, rc, p, t, v)
                                    if worst.peak_bytes <= usable:
                                        fitting.append(row)
                                        continue
                                    closest.append(row)
                                    reject(lambda: _config(mb, accum, attn, rc, p, v),
                                           f"peak {worst.peak_bytes} B allocated ({worst.stage} stage, {worst.phase}) "
                                           f"> usable {usable} B (reserved ≥ allocated)")
                                    for mb2 in mbs[i + 1:]:  # peaks only grow with the micro-batch
                                        reject(lambda: _config(mb2, per_rank // mb2, attn, rc, p, v),
                                               f"micro-batch {mb2} > {mb}, which already does not fit")
                                    break
    tokens = global_batch * seq

    def candidate(row) -> Candidate:
        total, worst, mb, accum, attn, rc, p, t, v = row
        return Candidate(_config(mb, accum, attn, rc, p, v), worst.peak_bytes, total, tokens / total,
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
                checked[key] = _recheck(model, base, profile, c, usable, finetune)
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
    calls += 2 * sum(True in k.phases for k in kernels.values())  # one-device variants accumulating
    stats = {"evaluated": evaluated, "fitting": len(fitting), "estimator_calls": calls,
             "checked": len(checked),
             "kernel_sets": [[a, rc] + ([v.describe()] if space.axes else []) for a, rc, v in kernels],
             "skipped_kernels": [{"attention": a, "recompute": "selective", "why": w} for a, w in noops.items()],
             "seconds": time.perf_counter() - t0,
             "method": "screen: closed form from two estimator calls (micro-batch 1 and 2) per distinct "
                       "(attention, recompute) saved set, scaled by the parallel degrees, allocated peak against the "
                       "reserved budget (reserved >= allocated); every peak shown: the estimator's per-rank peak "
                       "of that configuration, its reserved peak from the allocator model deciding the fit"}
    if space.axes:
        stats.update(axes=list(space.axes), skipped_variants=refused)
    return Plan(model, base, gpu, gpus, global_batch, reserve, usable, tuple(shown), tuple(pareto),
                tuple(rejected), stats)


MAX_FRONT = 12
"""Screened Pareto points checked by the estimator (evenly spaced when the screen finds more)."""


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


def _recheck(model: ModelSpec, base: StepSpec, profile: str, c: Candidate, usable: int,
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
