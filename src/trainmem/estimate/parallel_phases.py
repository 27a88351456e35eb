"""One rank class's phases: :func:`trainmem.estimate.peak.phases` run on a stage's items with the
stage's inputs gathered in a frozen :class:`StageInputs` (a ``PhaseInputs`` and the schedule's
numbers), a second time under GPipe for its later micro-batch's backward (``parallel_pp.later_microbatch``), then FSDP2's per-tensor regrading
(``fsdp_timeline.regrade``). :func:`trainmem.estimate.parallel.rank_classes` builds the inputs of
each stage and calls :func:`stage_phases`; nothing here reads a spec beyond the ``ParallelSpec``
the schedule's steps need.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Mapping

from trainmem.estimate import fsdp_timeline as ft
from trainmem.estimate.parallel_pp import (
    later_microbatch, optimizer_batch, sent_input_grad, with_later_microbatch, without_recv_aliases,
)
from trainmem.estimate.peak import Compiled, Phase, PhaseInputs, RankMoments, Recompute, phases
from trainmem.inventory import Inventory, MemoryItem
from trainmem.specs import ParallelSpec

__all__ = ["StageInputs", "stage_phases"]


@dataclass(frozen=True, init=False)
class StageInputs:
    """What one stage's phases are computed from, beside its items: its first micro-batch's
    :class:`~trainmem.estimate.phase_inputs.PhaseInputs` (``phase``), and what the schedule's steps need.

    Built from flat keywords (estimate/parallel.py ``_stage_inputs``): the step's, which ``PhaseInputs`` takes
    as they are; ``recompute`` (the per-block bytes) and ``recomputed`` (its :class:`Recompute`); ``block_math``
    (its :class:`Compiled`); ``node_moments``, ``grad_received``, ``logits_held``, ``middle_blocks``,
    ``fsdp_pp_grads``, ``ring`` (its :class:`RankMoments`).

    ``phase.grad_accum``: the accumulation the first micro-batch's backward sees; ``accumulated``: every
    gradient of the stage stored, as a later GPipe micro-batch's backward (and 1F1B's) sees it.
    ``body``: one micro-batch's stage activations (``parallel_pp.later_microbatch`` frees them).
    ``timeline``: FSDP2's per-tensor units (estimate/fsdp_timeline.py) or ``None``; with them the
    phases read the items as autograd holds them (``ft.autograd_view`` of ``own_states``)."""

    par: ParallelSpec
    phase: PhaseInputs
    accumulated: int
    body: int
    timeline: Any = None
    own_states: tuple[MemoryItem, ...] = ()
    param_bytes: int = 0
    deferred: Mapping[str, int] = None  # a later micro-batch's bf16 weight gradients (autocast_cache.py)

    def __init__(self, *, par: ParallelSpec, accumulated: int, body: int, recompute: Mapping[int, tuple[int, int]],
                 recomputed: Inventory | None, node_moments: bool, grad_received: bool, logits_held: bool,
                 fsdp_pp_grads: int, timeline: Any = None, own_states: tuple[MemoryItem, ...] = (),
                 param_bytes: int = 0, middle_blocks: Any = None, block_math: Any = None, ring: Any = None,
                 deferred: Mapping[str, int] | None = None, **step: Any) -> None:
        phase = PhaseInputs(**step, recompute=Recompute(per_block=recompute, recomputed=recomputed),
                            compiled=Compiled(block_math=block_math),
                            rank=RankMoments(node_moments=node_moments, grad_received=grad_received,
                                             logits_held=logits_held, middle_blocks=middle_blocks,
                                             fsdp_pp_grads=fsdp_pp_grads, ring=ring))
        if accumulated < phase.grad_accum:
            raise ValueError(f"StageInputs: grad_accum={phase.grad_accum}, accumulated={accumulated}")
        for k, v in (("par", par), ("phase", phase), ("accumulated", accumulated), ("body", body),
                     ("timeline", timeline), ("own_states", own_states), ("param_bytes", param_bytes),
                     ("deferred", dict(deferred or {}))):
            object.__setattr__(self, k, v)


def stage_phases(inp: StageInputs, items: list[MemoryItem]) -> list[Phase]:
    """The stage's phases: the first micro-batch's, each backward the larger of it and GPipe's second
    micro-batch's where that applies (estimate/parallel_pp.py ``later_microbatch``), FSDP2's units
    holding their sharded gradients after the phase that reduce-scatters them."""
    # 1F1B's phases are a later micro-batch's (its gradients accumulated); GPipe's first pass is the first one's
    ph = _phases(inp, items, inp.phase.grad_accum, later=inp.phase.grad_accum == inp.accumulated > 1)
    if (later := later_microbatch(inp.par, items, inp.body)) is not None:
        ph = with_later_microbatch(ph, _phases(inp, later, inp.accumulated, later=True))
    if inp.timeline is not None:
        ph = ft.regrade(ph, inp.timeline)
    return ph


def _phases(inp: StageInputs, items: list[MemoryItem], grad_accum: int, *, later: bool = False) -> list[Phase]:
    items = without_recv_aliases(items)  # the stage's first block is its own (parallel_pp.py)
    if inp.timeline is not None:
        items = ft.autograd_view(items, list(inp.own_states), param_bytes=inp.param_bytes,
                                 offload=inp.timeline.host_grads)
    ph = inp.phase
    if later and inp.deferred:  # a later micro-batch's deferred weight-copy gradients (estimate/autocast_cache.py)
        working = ph.working_by_phase()
        ph = replace(ph, working={**working, **{k: {**working.get(k, {}), "deferred_cast_grads": v}
                                               for k, v in inp.deferred.items()}})
    if grad_accum > inp.phase.grad_accum:  # GPipe's second micro-batch: the first one's input gradient was sent
        ph = replace(ph, working=sent_input_grad(ph.working_by_phase(), ph.residual_bytes))
    return phases(items, replace(ph, grad_accum=grad_accum, optimizer_batch=optimizer_batch(
        inp.par, items, batch=ph.batch, seq=ph.seq, loss=ph.loss)))
