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

This module runs the search; the screen of every layout is :mod:`trainmem.plan.screen`, the
estimator's recheck and the Pareto front :mod:`trainmem.plan.shortlist`, and the result objects
:mod:`trainmem.plan.result`.

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
from functools import partial

from trainmem.errors import SpecError
from trainmem.families import family_attentions
from trainmem.plan.axes import saved_sets
from trainmem.plan.cost import CostModel, matmul_parameters
from trainmem.plan.hardware import GPU, Reserve
from trainmem.plan.result import SCHEMA, Candidate, Plan
from trainmem.plan.screen import SearchSpace, screen
from trainmem.plan.shortlist import recheck, shortlist
from trainmem.specs import ModelSpec, StepSpec

__all__ = ["SearchSpace", "Candidate", "Plan", "plan", "SCHEMA"]


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

    found = screen(model, seq=seq, global_batch=global_batch, gpu=gpu, gpus=gpus, space=space, kernels=kernels,
                   usable=usable, cost=cost, n_params=n_params, keep_rejected=keep_rejected, finetune=finetune)
    fitting, rejected = found.fitting, found.rejected
    shown, pareto, checked = shortlist(fitting, found.closest, top=top, front=front, tokens=global_batch * seq,
                                       usable=usable, rejected=rejected,
                                       check=partial(recheck, model, base, profile, usable=usable, finetune=finetune))
    calls += 2 * sum(True in k.phases for k in kernels.values())  # one-device variants accumulating
    stats = {"evaluated": found.evaluated, "fitting": len(fitting), "estimator_calls": calls,
             "checked": checked,
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
