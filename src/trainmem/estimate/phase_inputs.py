"""What a step's phases (estimate/peak.py ``phases``) are computed from, beside its items: the step's numbers
and the mechanisms that change which moments the phases take, grouped by who sets them.

* :class:`PhaseInputs` -- the step: micro-batch, sequence, vocabulary, dtypes, loss, accumulation, the residual
  stream's bytes, the optimizer's temporaries, the buffers alive beside the tensors; the groups below.
* :class:`Recompute` -- activation checkpointing: what each checkpointed block recomputes in its backward.
* :class:`Compiled` -- torch.compile: the compiled loss, the compiled block's math, the head's own graph.
* :class:`RankMoments` -- what a rank class under parallelism changes in the block moments (pipeline
  receive buffers, FSDP2's middle blocks and unsharded gradients, CP's ring).

One device builds one in ``estimate/__init__.py``; a pipeline stage from its
:class:`~trainmem.estimate.parallel_phases.StageInputs`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

from trainmem.estimate.attention import KERNELS
from trainmem.inventory import DTYPE_BYTES, Inventory
from trainmem.specs.step import LOSSES

__all__ = ["PhaseInputs", "Recompute", "Compiled", "RankMoments"]

#: ``loss='none'``: this rank computes no loss (a pipeline stage before the last)
PHASE_LOSSES = (*LOSSES, "none")


@dataclass(frozen=True, kw_only=True)
class Recompute:
    """Activation checkpointing as the phases see it."""

    per_block: Mapping[int, tuple[int, int]] = field(default_factory=dict)
    """Block -> (bytes, largest tensor) it re-materializes in its backward (estimate/layer_stats.py
    ``recompute_per_layer``); empty without checkpointing."""
    recomputed: Inventory | None = None
    """The inventory without checkpointing: a checkpointed block's node moments run on its recomputed tensors
    (estimate/block_backward.py, estimate/compiled_op_moment.py); ``None``: the block working set bounds them."""
    attention_only: bool = False
    """``--recompute selective``: only the attention core is recomputed, so the blocks' node moments read
    their saved sets."""


@dataclass(frozen=True, kw_only=True)
class Compiled:
    """torch.compile's effects on the phases."""

    loss: bool = False
    """torchtune's chunk function runs compiled (estimate/compiled_chunk_loss.py)."""
    block_math: Mapping[str, Any] | None = None
    """The block's MLP activation and norm kind its compiled checkpoint moments read (``activation``,
    ``unit_offset_norm``; ``eager_set``: a fine-tuned compiled block; ``one_graph``: the whole model in one
    graph): estimate/compiled_recompute.py ``block_math``."""
    head_graph_apart: bool = False
    """Whole-model compile runs the head in a graph of its own (estimate/compiled_embedding_backward.py)."""


@dataclass(frozen=True, kw_only=True)
class RankMoments:
    """What a rank class under parallelism changes in its blocks' backward moments."""

    node_moments: bool = False
    """Model a block's node moments beside the ``working`` buffers too (they are the same through the block's
    backward: FSDP2's, estimate/fsdp_timeline.py; a pipeline stage's, estimate/parallel_pp.py)."""
    grad_received: bool = False
    """The last block's output gradient is a receive buffer counted in ``working`` (a pipeline stage before the
    last: ``pp_recv_gradients``), not a new residual gradient in its eager moments before the residual sum."""
    logits_held: bool = False
    """The logits outlive the loss (a pipeline's output chunks), so the compiled loss's backward does not free
    them."""
    middle_blocks: Mapping[int, tuple[int, Mapping[str, int]]] | None = None
    """FSDP2 (estimate/fsdp_timeline.py ``middle_blocks``): blocks between the first and the last whose backward
    moment is taken too, each with its gradient correction (the later blocks hold sharded gradients, not
    autograd's) and the buffers alive there instead of ``working``'s."""
    fsdp_pp_grads: int = 0
    """FSDP2's shard group per pipeline stage (estimate/parallel_pp.py ``fsdp_stage_moments``): a node moment's
    gradients are the block's new ones, unsharded, beside the unsharded buffer ``working`` holds."""
    ring: Any = None
    """Context parallelism's ring buffers per rank class (estimate/context_parallel.py ``RingBuffers``): moments
    of each block's attention backward and of the last block's attention forward (estimate/cp_ring_moments.py)."""

    def __post_init__(self) -> None:
        if self.fsdp_pp_grads < 0:
            raise ValueError(f"RankMoments: fsdp_pp_grads={self.fsdp_pp_grads} (a shard group size, or 0)")


@dataclass(frozen=True, kw_only=True)
class PhaseInputs:
    """The step's numbers and mechanisms (the module docstring). Bytes are ints; dtypes are the inventory's."""

    batch: int
    seq: int
    vocab: int
    """The logits' width (the vocabulary, or a classifier's labels: estimate/heads.py ``logits_width``)."""
    logits_dtype: str
    loss_dtype: str
    """The log-softmax's dtype (fp32 unless the loss runs in the logits' dtype)."""
    loss: str
    grad_accum: int
    residual_bytes: int
    """One residual-stream tensor, B·S·H in the computation dtype (per rank: /tp under SP)."""
    optimizer_transient: tuple[int, str]
    """``optimizer.step()``'s temporaries and the rule that gives them; with ``optimizer_in_backward``, one
    parameter's."""
    persistent: Mapping[str, int] = field(default_factory=dict)
    """Buffers alive through the whole step (DDP buckets)."""
    working: Mapping[str, int] | Mapping[str, Mapping[str, int]] = field(default_factory=dict)
    """Buffers alive during forward and backward (FSDP all-gathers, ring buffers): one dict for every such phase
    or a dict per phase name."""
    optimizer_in_backward: bool = False
    """torchtune's ``optimizer_in_bwd``: each parameter steps in its post-accumulate-grad hook."""
    accumulate_transients: bool = False
    """With ``grad_accum`` > 1, each new gradient beside the stored ``.grad`` it is added into
    (estimate/grad_accum.py; one device)."""
    attention_kernel: str | None = None
    """The kernel the blocks' attention cores run (estimate/attention.py ``kernel_for``, one of ``KERNELS``): the
    math kernel's recomputed core has moments of its own under ``--recompute selective``
    (estimate/selective_moments.py ``math_core_moments``). ``None``: not given (estimate/parallel.py's rank classes,
    whose selective blocks take no such moment)."""
    tied_head: bool = False
    """The output layer is the input embedding's weight (estimate/peak.py's module docstring)."""
    stack_held: int = 0
    """``--profile traced``, an encoder-decoder: the last stack's locals at its end, besides the kept tensors
    (``traced/record.py`` ``_held``): the ``stack_end`` phase."""
    stacks: tuple[tuple[str, int], ...] = ()
    optimizer_batch: int = 0
    """The caller's batch while ``optimizer.step()`` runs, which no item counts there (the activations are gone):
    its token ids, (B, S) int64 (estimate/__init__.py; a pipeline stage's: estimate/parallel_pp.py
    ``optimizer_batch``). A training loop binds its batch for the whole step (``trace/step.py`` ``one_step``
    registers ``inputs`` for all of it; tests/estimate/real_steps.py holds ``ids``)."""
    """``--profile traced``: the template's stacks of blocks (``Template.stacks``), blocks counted through
    both (estimate/layer_stats.py ``layer_stats``)."""
    recompute: Recompute = Recompute()
    compiled: Compiled = Compiled()
    rank: RankMoments = RankMoments()

    def __post_init__(self) -> None:
        bad = {k: getattr(self, k) for k in ("batch", "seq", "grad_accum") if getattr(self, k) < 1}
        bad |= {k: getattr(self, k) for k in ("vocab", "residual_bytes", "stack_held", "optimizer_batch")
                if getattr(self, k) < 0}
        if self.optimizer_transient[0] < 0:
            bad["optimizer_transient"] = self.optimizer_transient
        if self.attention_kernel not in (None, *KERNELS):
            bad["attention_kernel"] = self.attention_kernel
        if self.loss not in PHASE_LOSSES:
            bad["loss"] = self.loss
        bad |= {k: getattr(self, k) for k in ("logits_dtype", "loss_dtype") if getattr(self, k) not in DTYPE_BYTES}
        if bad:
            raise ValueError("PhaseInputs: " + ", ".join(f"{k}={v!r}" for k, v in bad.items()))

    @property
    def tokens(self) -> int:
        return self.batch * self.seq

    def working_by_phase(self) -> dict[str, dict[str, int]]:
        """``working`` as one dict per phase name: a single dict is every forward and backward phase's."""
        working = dict(self.working or {})
        if working and not isinstance(next(iter(working.values())), dict):
            return {p: dict(working) for p in ("forward", "backward_start", "backward", "backward_end")}
        return working
