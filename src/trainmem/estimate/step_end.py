"""The end of a step's backward and its optimizer step (estimate/peak.py): ``backward_end`` (every gradient, the
embedding's backward last: a tied weight's two gradients and their sum, a whole-model compile's index-put),
``optimizer`` (with gradient accumulation's later micro-batch, estimate/grad_accum.py), or, with the optimizer
in backward, ``step_in_backward`` (peak.py's module docstring).
"""

from __future__ import annotations

from trainmem.estimate.compiled_embedding_backward import embedding_backward_parts
from trainmem.estimate.phase import Phase
from trainmem.estimate.phase_inputs import PhaseInputs
from trainmem.estimate.phase_parts import (
    StepSums, Timeline, embedding_outputs, head_weight_bytes, largest_block_grad, later_embedding_indices,
    shared_block_inputs,
)
from trainmem.inventory import Inventory, dtype_bytes

__all__ = ["end_phases"]


def end_phases(tl: Timeline, items, inp: PhaseInputs, s: StepSums, blocks: set[int]) -> list[Phase]:
    """Add ``backward_end`` and the optimizer's phase to ``tl``; the step's phases."""
    st, A, head_act = s.st, s.A, s.st.head_act
    # the embedding's backward runs last: the blocks' shared inputs (rotary cos/sin) and the embedding
    # output block 0 kept (its norm's input in fp32) were freed by the first block's nodes; the
    # embedding keeps its indices
    end_freed = shared_block_inputs(items) + embedding_outputs(items) if blocks else 0
    acts_end = A - head_act - sum(st.act_layer.values()) - end_freed
    loss_scalars = s.loss_scalars(inp)
    acts_end = _backward_end(tl, items, inp, s, acts_end, loss_scalars)
    tb, rule = inp.optimizer_transient
    if not inp.optimizer_in_backward:
        tl.add("optimizer", {"gradients": s.G, "optimizer_temporaries": tb}, f"optimizer.step(): {rule}")
        if inp.accumulate_transients:  # estimate/grad_accum.py: the new gradients of a later micro-batch
            from trainmem.estimate.grad_accum import with_accumulation
            return with_accumulation(
                tl.out, items, grad_accum=inp.grad_accum, loss=inp.loss, loss_dtype=inp.loss_dtype,
                logits_grad=int(s.BSV * dtype_bytes(inp.logits_dtype)), residual_bytes=inp.residual_bytes,
                head_grad=head_weight_bytes(items), tied=inp.tied_head and inp.loss != "none", gradients=s.G,
                head_acts=A - st.loss_act, block_acts=A - head_act, static=s.static,
                bufs={**tl.persistent, **{k: v for k, v in tl.working.get("backward_start", {}).items() if v}})
        return tl.out
    # the head's weight gradient exists next to the logits' gradient that produced it, in the logits'
    # dtype (bf16 + ce: ToCopyBackward0 casts the fp32 log-softmax gradient back, and the engine frees
    # that before MmBackward runs; real CPU steps: tests/estimate/test_untied_in_backward.py, tied:
    # test_tied_in_backward.py); by its hook that gradient and the head's saved input (residual-sized)
    # are freed, the loss's are too, but for the loss and its seed gradient
    residual = inp.residual_bytes
    logits_grad = int(s.BSV * dtype_bytes(inp.logits_dtype)) if inp.loss == "ce" else 0
    if s.tied_G:
        tl.add("step_in_backward", *_tied_steps(
            head={"activations": A - st.loss_act, "loss_scalars": loss_scalars, "work": residual,
                  "gradients": s.tied_G, "logits_grad": logits_grad},
            block=_block_step(largest_block_grad(items), st.largest_grad, tb, A - head_act, residual, s.tied_G),
            last={"activations": acts_end, "loss_scalars": loss_scalars, "gradients": s.tied_G,
                  "optimizer_temporaries": tb}, rule=rule))
        return tl.out
    at_mm = logits_grad >= tb - residual
    held = {"logits_grad": logits_grad} if at_mm else {"optimizer_temporaries": tb}
    acts = A - st.loss_act - (0 if at_mm else residual)
    tl.add("step_in_backward", {"activations": acts, "work": residual, "gradients": st.largest_grad,
                                "loss_scalars": loss_scalars, **held},
           f"largest parameter stepped in its gradient hook while activations are alive: {rule}; "
           "the larger of its temporaries and the log-softmax gradient that produced it")
    return tl.out


def _backward_end(tl: Timeline, items, inp: PhaseInputs, s: StepSums, acts_end: int, loss_scalars: int) -> int:
    """``backward_end``: every gradient exists (or was stepped in backward), the block activations are freed.
    The activations alive at the embedding's backward, the last node, are returned."""
    end_note = ("all gradients exist, block activations freed" if not inp.optimizer_in_backward
                else "gradients were stepped and freed in backward, block activations freed")
    stored_G, tied_sum = s.stored_G, s.tied_sum
    g_end, work_end = stored_G, inp.residual_bytes
    # the gradients alive beside this micro-batch's tied-weight gradients: the sum becomes the
    # weight's .grad (AccumulateGrad steals it; counted in stored_G) unless a .grad from an earlier
    # micro-batch exists; in backward the hook steps it and no gradient is stored
    before = stored_G - (tied_sum if stored_G and inp.grad_accum == 1 else 0)
    if tied_sum:  # the token embedding's backward runs last: the others (positions) freed their ids
        acts_end -= later_embedding_indices(items)
    if tied_sum and tied_sum >= inp.residual_bytes:
        # torch/csrc/autograd/input_buffer.cpp (accumulate): the head's gradient (a transposed mm
        # result) and the embedding's are summed out of place, after the embedding node released
        # its output gradient; the sum is what AccumulateGrad (and its hook) gets
        g_end, work_end = before + 3 * tied_sum, 0
        end_note += "; the tied weight's head and embedding gradients and their sum"
    elif tied_sum:
        g_end = before + 2 * tied_sum
        end_note += "; the tied weight's head and embedding gradients"
    end = {"gradients": g_end, "activations": acts_end, "work": work_end, "loss_scalars": loss_scalars}
    if (inp.compiled.block_math or {}).get("one_graph"):  # the whole model compiled: compiled_embedding_backward.py
        emb = embedding_backward_parts(items.base if isinstance(items, Inventory) else items, B=inp.batch, S=inp.seq,
                                       stored_grads=stored_G, grad_accum=inp.grad_accum, tied=bool(tied_sum),
                                       activations=acts_end, loss_scalars=loss_scalars,
                                       head_grad=head_weight_bytes(items),
                                       head_graph_apart=inp.compiled.head_graph_apart)
        if emb and sum(emb.values()) > sum(end.values()):
            end, end_note = emb, ("the compiled embedding backward's index-put, the last node: two (V, H) tables in "
                                  "the computation dtype beside the other gradients (embedding_dense_backward)")
    tl.add("backward_end", end, end_note)
    return acts_end


def _block_step(big: int, largest: int, tb: int, acts: int, residual_bytes: int, tied_grad: int) -> dict[str, int]:
    """The last block's largest parameter (``big`` gradient bytes) stepped next to the tied head
    gradient: ``tb`` is the largest parameter's temporaries (``largest`` bytes), scaled to the
    block's (every one-tensor rule in estimate/optimizer_step.py is a multiple of its bytes)."""
    return {"activations": acts, "work": residual_bytes, "gradients": tied_grad + big,
            "optimizer_temporaries": tb * big // largest if largest else 0}


def _tied_steps(*, head: dict[str, int], block: dict[str, int], last: dict[str, int], rule: str
                ) -> tuple[dict[str, int], str]:
    """The largest of the three moments a tied head's step-in-backward has (peak.py's module docstring)."""
    notes = {"head": "the tied head's matmul backward: its weight gradient (stepped last, when the "
                     "embedding's arrives) next to the log-softmax gradient that produced it",
             "block": f"the last block's largest parameter stepped next to the tied head gradient: {rule}",
             "last": f"the tied weight stepped last, in its one hook: {rule}"}
    name, parts = max((("head", head), ("block", block), ("last", last)), key=lambda kv: sum(kv[1].values()))
    return parts, notes[name]
