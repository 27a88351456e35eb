"""One rank class's phases: :func:`trainmem.estimate.peak.phases` run on a stage's items with the
stage's inputs gathered in a frozen :class:`StageInputs`, a second time under GPipe for its later
micro-batch's backward (``parallel_pp.later_microbatch``), then FSDP2's per-tensor regrading
(``fsdp_timeline.regrade``). :func:`trainmem.estimate.parallel.rank_classes` builds the inputs of
each stage and calls :func:`stage_phases`; nothing here reads a spec beyond the ``ParallelSpec``
the schedule's steps need.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from trainmem.estimate import fsdp_timeline as ft
from trainmem.estimate.parallel_pp import later_microbatch, with_later_microbatch, without_recv_aliases
from trainmem.estimate.peak import Phase, phases
from trainmem.inventory import Inventory, MemoryItem
from trainmem.specs import ParallelSpec

__all__ = ["StageInputs", "stage_phases"]


@dataclass(frozen=True)
class StageInputs:
    """What one stage's phases are computed from, beside its items (``peak.phases``' arguments).

    ``grad_accum``: the accumulation the first micro-batch's backward sees; ``accumulated``: every
    gradient of the stage stored, as a later GPipe micro-batch's backward (and 1F1B's) sees it.
    ``body``: one micro-batch's stage activations (``parallel_pp.later_microbatch`` frees them).
    ``timeline``: FSDP2's per-tensor units (estimate/fsdp_timeline.py) or ``None``; with them the
    phases read the items as autograd holds them (``ft.autograd_view`` of ``own_states``)."""

    par: ParallelSpec
    batch: int
    seq: int
    vocab: int
    logits_dtype: str
    loss_dtype: str
    loss: str
    grad_accum: int
    accumulated: int
    body: int
    recompute: Mapping[int, tuple[int, int]]
    optimizer_transient: tuple[int, str]
    residual_bytes: int
    persistent: Mapping[str, int]
    working: Mapping[str, Mapping[str, int]]
    node_moments: bool
    grad_received: bool
    logits_held: bool
    recomputed: Inventory | None
    tied_head: bool
    fsdp_pp_grads: int
    timeline: Any = None
    own_states: tuple[MemoryItem, ...] = ()
    param_bytes: int = 0
    middle_blocks: Any = None
    block_math: Any = None
    ring: Any = None  # CP's ring buffers per rank class (estimate/context_parallel.py RingBuffers)

    def __post_init__(self) -> None:
        if self.grad_accum < 1 or self.accumulated < self.grad_accum:
            raise ValueError(f"StageInputs: grad_accum={self.grad_accum}, accumulated={self.accumulated}")


def stage_phases(inp: StageInputs, items: list[MemoryItem]) -> list[Phase]:
    """The stage's phases: the first micro-batch's, each backward the larger of it and GPipe's second
    micro-batch's where that applies (estimate/parallel_pp.py ``later_microbatch``), FSDP2's units
    holding their sharded gradients after the phase that reduce-scatters them."""
    ph = _phases(inp, items, inp.grad_accum)
    if (later := later_microbatch(inp.par, items, inp.body)) is not None:
        ph = with_later_microbatch(ph, _phases(inp, later, inp.accumulated))
    if inp.timeline is not None:
        ph = ft.regrade(ph, inp.timeline)
    return ph


def _phases(inp: StageInputs, items: list[MemoryItem], grad_accum: int) -> list[Phase]:
    items = without_recv_aliases(items)  # the stage's first block is its own (parallel_pp.py)
    if inp.timeline is not None:
        items = ft.autograd_view(items, list(inp.own_states), param_bytes=inp.param_bytes,
                                 offload=inp.timeline.host_grads)
    return phases(
        items, B=inp.batch, S=inp.seq, vocab=inp.vocab, logits_dtype=inp.logits_dtype, loss_dtype=inp.loss_dtype,
        loss=inp.loss, grad_accum=grad_accum, recompute_bytes=inp.recompute,
        optimizer_transient=inp.optimizer_transient, residual_bytes=inp.residual_bytes,
        persistent=inp.persistent, node_moments=inp.node_moments, working=inp.working,
        grad_received=inp.grad_received, logits_held=inp.logits_held, recomputed=inp.recomputed,
        tied_head=inp.tied_head, middle_blocks=inp.middle_blocks, block_math=inp.block_math,
        fsdp_pp_grads=inp.fsdp_pp_grads, ring=inp.ring,
    )
