"""The peak is not a sum: model the step in phases and take the largest live set.

Phases of a steady-state step (optimizer state exists; gradients were zeroed with
``set_to_none``; only ``loss`` is kept from the outputs):

* ``forward``        -- end of forward, inside the loss: all saved activations, plus the logits
                        and their fp32 copy that the output object still holds.
* ``stack_end``      -- ``--profile traced``, an encoder-decoder: the decoder stack's last op, its
                        locals (T5's position biases, input embeddings, KV cache) beside every kept
                        tensor but the head's (``traced/record.py`` ``_held``).
* ``backward_start`` -- the loss backward: all activations, plus the gradient of the
                        log-softmax output and of the fp32 logits (two B·S·V·4 tensors).
* ``backward``       -- backward of the last block: head gradients exist, the last block's
                        recomputed activations (if checkpointed) and its gradient working set.
* ``backward_first_block`` -- backward of the first block, which runs last: every later
                        gradient exists beside its recomputed activations and working set (the
                        peak under full recompute when the optimizer step is not the peak).
* ``backward_end``   -- every gradient exists, activations are gone.
* ``optimizer``      -- every gradient plus the optimizer's temporaries.

With gradient accumulation, gradients exist from the second micro-batch on, so they are
counted in every phase (the peak does not grow with the number of micro-batches).

With the optimizer in backward (torchtune's ``optimizer_in_bwd``: each parameter steps in its
post-accumulate-grad hook, which then frees the gradient) no phase holds the gradients and the
``optimizer`` phase is replaced by ``step_in_backward``: the largest parameter's gradient and
step temporaries, taken at the head (its gradient arrives while every activation is alive; the
log-softmax gradient that produced it is alive until the step starts, the head's input gradient
throughout). An embedding-sized parameter stepped later, with fewer activations alive, costs less:
the phase is an upper bound there. A tied head is the exception (``tied_head``): the shared
weight has one post-accumulate-grad hook, which fires once, after autograd summed its two
gradients, the head's (first) and the embedding's (last). So its head gradient stays alive from
the head's backward to the end, ``backward_end`` holds the two and their sum, and the shared
weight steps last (its temporaries then); ``step_in_backward`` is the largest of the head's
matmul (no step there), the last block's largest parameter stepped next to the head gradient, and
that last step.
"""

from __future__ import annotations

from trainmem.estimate.backward_moments import block_phases, blocks_of
from trainmem.estimate.layer_stats import LayerStats, layer_stats, recompute_per_layer
from trainmem.estimate.loss_moments import loss_phases, stack_end_phase
from trainmem.estimate.phase import Phase
from trainmem.estimate.phase_inputs import Compiled, PhaseInputs, RankMoments, Recompute
from trainmem.estimate.phase_parts import StepSums, Timeline
from trainmem.estimate.step_end import end_phases
from trainmem.inventory import Inventory, MemoryItem

__all__ = ["Phase", "PhasedResult", "LayerStats", "PhaseInputs", "Recompute", "Compiled", "RankMoments", "phases",
           "layer_stats", "recompute_per_layer"]


class PhasedResult:
    """Shared by results that have an ``inventory`` and ``phases``: totals and the peak."""

    inventory: Inventory
    phases: tuple[Phase, ...]

    @property
    def totals_bytes(self) -> dict[str, int]:
        return self.inventory.totals()

    @property
    def peak(self) -> Phase:
        return max(self.phases, key=lambda p: p.bytes)

    @property
    def peak_bytes(self) -> int:
        return self.peak.bytes


def phases(items: "Inventory | list[MemoryItem]", inp: PhaseInputs) -> list[Phase]:
    """The live bytes of each phase of the step ``inp`` describes (estimate/phase_inputs.py), in order: the
    loss's and the head's (estimate/loss_moments.py), the blocks' (estimate/backward_moments.py), the end of
    backward and the optimizer's (estimate/step_end.py)."""
    sums = StepSums.of(items, inp)
    tl = Timeline(items, inp, sums)
    loss_phases(tl, items, inp, sums)
    stack_end_phase(tl, inp, sums)
    block_phases(tl, items, inp, sums)
    return end_phases(tl, items, inp, sums, blocks_of(inp, sums))
