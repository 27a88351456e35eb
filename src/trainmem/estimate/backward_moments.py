"""The blocks' moments of a step (estimate/peak.py): the last block's attention forward under CP's ring, the
``backward`` phase (the last block's backward, FSDP2's and every-k's middle blocks, the final norm's backward)
and ``backward_first_block`` (the first block's backward, which runs last).

A block's moment is the larger of its working set (the recomputed activations of a checkpointed block, the
output gradient and the gradient of its largest saved tensor) and its nodes' moments (estimate/block_backward.py:
its MLP product's and norms' backward; estimate/compiled_recompute.py: a checkpointed compiled block's;
estimate/cp_ring_moments.py: the ring attention's backward), with the block's gradients made by then.
"""

from __future__ import annotations

from trainmem.estimate.block_backward import final_norm_moment, node_moments_modelled, norm_backward_parts
from trainmem.estimate.compiled_recompute import compiled_checkpoint_moments
from trainmem.estimate.cp_ring_moments import before_the_head, ring_attention_moments, ring_forward_held
from trainmem.estimate.phase_inputs import PhaseInputs
from trainmem.estimate.phase_parts import StepSums, Timeline, held_and_recomputed, shared_block_inputs, stored_and_new
from trainmem.estimate.selective_moments import math_core_moments, saved_after_attention

__all__ = ["block_phases", "blocks_of"]


def blocks_of(inp: PhaseInputs, s: StepSums) -> set[int]:
    """The blocks that run a backward: a checkpointed block may keep nothing under its own name (``--profile
    traced`` names the held input by the op that made it, in the block before): it still recomputes."""
    return set(s.st.act_layer) | set(inp.recompute.per_block)


def block_phases(tl: Timeline, items, inp: PhaseInputs, s: StepSums) -> None:
    """Fold CP's ring forward moment into ``forward`` and add ``backward`` and ``backward_first_block``."""
    st, A, G, head_act = s.st, s.A, s.G, s.st.head_act
    rec_bytes, rank = inp.recompute.per_block, inp.rank
    blocks = blocks_of(inp, s)
    last = max(blocks) if blocks else None
    if last is not None and (fwd := ring_forward_held(items, last, A - head_act - st.act_layer.get(last, 0),
                                                      rank.ring, inp.recompute.recomputed)):
        at = next(k for k, p in enumerate(tl.out) if p.name == "forward")  # CP's ring inside the last attention
        tl.add("forward", {"gradients": s.g_acc, **fwd}, "the last block's ring attention forward: the activations "
               "kept so far, the block's attention inputs and the ring's buffers (estimate/cp_ring_moments.py)",
               own=before_the_head(tl.working.get("forward", {})))  # the loss's extras do not exist yet
        tl.keep_larger(at)
    if last is None:
        return
    # the gradient of the block output, plus the gradient of the largest saved tensor
    # while that tensor is still held (e.g. dP next to P in eager attention)
    rec, rec_big = rec_bytes.get(last, (0, 0))
    big = max(st.largest.get(last, 0), rec_big)
    work = rec + inp.residual_bytes + big
    # beside a head the late gradient does not exist yet (cf2822d, measured on one device); a stage before the
    # last (no head) keeps it counted, as before cf2822d: without it the compiled GPipe stage 0 read 0.981 of the
    # fake-PG trace (tests/estimate/test_compiled_3d.py), a moment not explained yet
    late = st.late_grad if st.has_head else 0
    g_now = G if inp.grad_accum > 1 else s.grads_head - late if not inp.optimizer_in_backward else s.tied_G
    # a checkpointed block keeps only what later nodes saved of it: the last block's output, the final norm's input,
    # which that norm's backward released before this block's recompute (engine.cpp Node::release_variables)
    held_by_norm = st.act_layer.get(last, 0) if last in rec_bytes and inp.recompute.recomputed is not None and \
        not inp.recompute.attention_only else 0
    parts = {"gradients": g_now, "activations": A - head_act - held_by_norm, "recompute_and_work": work,
             "router_logits_grad": sum(s.router_grads.values())}  # every block's router backward is to come
    note = ("backward of the last block: head gradients, remaining activations, recomputed "
            "block activations, the output gradient and the gradient of its largest tensor")
    g_last = G if inp.grad_accum > 1 else s.grads_head - st.late_grad
    parts, note = _inside(tl, items, inp, s, blocks, last, g_last, A - head_act, parts, note)
    fn = final_norm_moment(items, head_act=head_act, loss_scalars=s.loss_scalars(inp))
    if fn and not inp.optimizer_in_backward and not tl.node_moments_off(rank.node_moments):
        at = {"gradients": g_last, "activations": A - head_act + fn[0], "node_work": fn[1],
              "router_logits_grad": parts.get("router_logits_grad", 0)}
        if sum(at.values()) > sum(parts.values()):
            parts, note = at, ("the final RMSNorm's backward: the head's gradients, the blocks' activations "
                               "and the norm's five fp32 temporaries (estimate/block_backward.py)")
    tl.add("backward", parts, note)
    for li, (g_fix, own) in sorted({**_mixed_middle(blocks, rec_bytes), **(rank.middle_blocks or {})}.items()):
        # a middle block holds what neither end does (FSDP2: the next block's prefetch beside the previous
        # one's reduce-scatter input), so the ends do not bound it: its moment, as the first block's below
        rec_i, big_i = rec_bytes.get(li, (0, 0))
        g_i = G - sum(v for j, v in st.grad_layer.items() if j <= li) - st.late_grad + g_fix
        acts_i = A - head_act - sum(v for j, v in st.act_layer.items() if j > li)
        tl.add("backward", *_inside(tl, items, inp, s, blocks, li, g_i, acts_i, {
            "gradients": g_i, "activations": acts_i, "recompute_and_work": rec_i + inp.residual_bytes + max(
                st.largest.get(li, 0), big_i), "router_logits_grad": sum(v for j, v in s.router_grads.items() if j <= li)},
            f"backward of block {li}: the later blocks' gradients, its recomputed block activations, the output "
            "gradient and the gradient of its largest tensor"), own=own)
        tl.out[-2:] = [max(tl.out[-2:], key=lambda p: p.bytes)]  # one backward phase: the largest block moment
    first = min(blocks)
    if first != last and not inp.optimizer_in_backward:
        # the first block's backward runs last: every later block's gradients exist next to its
        # recomputed activations and working set. Live bytes are linear in the block index between
        # the two ends (gradients accumulate, activations drain), so the ends bound every block.
        rec0, rec_big0 = rec_bytes.get(first, (0, 0))
        work0 = rec0 + inp.residual_bytes + max(st.largest.get(first, 0), rec_big0)
        g_first = G if inp.grad_accum > 1 else G - st.grad_layer.get(first, 0) - st.late_grad
        acts0 = A - head_act - sum(st.act_layer.values()) + st.act_layer.get(first, 0)
        tl.add("backward_first_block", *_inside(
            tl, items, inp, s, blocks, first, g_first, acts0,
            {"gradients": g_first, "activations": acts0 - _output_released(inp, st, first),
             "recompute_and_work": work0,
             "router_logits_grad": s.router_grads.get(first, 0)},
            "backward of the first block, the last to run: every later gradient exists, its "
            "recomputed block activations, the output gradient and the gradient of its largest tensor"))


def _inside(tl: Timeline, items, inp: PhaseInputs, s: StepSums, blocks: set[int], li: int, grads_before: int,
            acts_before: int, parts: dict, note: str) -> tuple[dict, str]:
    """The larger of block ``li``'s working set and its nodes' moments (estimate/block_backward.py):
    its MLP product's and RMSNorms' backward, with the block's gradients made by then."""
    rc, rank, block_math = inp.recompute, inp.rank, inp.compiled.block_math
    rec_bytes, recomputed, residual = rc.per_block, rc.recomputed, inp.residual_bytes
    if (li in rec_bytes and recomputed is None and not rc.attention_only) or inp.optimizer_in_backward or \
            tl.node_moments_off(rank.node_moments):
        return parts, note
    # a checkpointed block recomputed its forward first: its tensors are alive beside the rest; they are not
    # inventory items (a checkpoint keeps only the block's input), so they get their own part, "recomputed"
    rec_add = rec_bytes.get(li, (0, 0))[0] if recomputed is not None else 0
    rec_li = recomputed if li in rec_bytes else None
    # a checkpointed compiled block's MLP moments (estimate/compiled_recompute.py; none for eager sets)
    # a fine-tuned compiled block (block_math eager_set) runs no eager nodes: compiled_finetune_moment.py's
    eager_nb = [] if (block_math or {}).get("eager_set") else norm_backward_parts(items, li, residual, rec_li)
    eager_nb += ring_attention_moments(items, li, residual, rank.ring, rec_li)
    if rc.attention_only and eager_nb:  # selective: the core recomputed on SDPA's math kernel (selective_moments.py)
        eager_nb += math_core_moments(items, li, kernel=inp.attention_kernel, residual_bytes=residual,
                                      recomputed=rec_bytes.get(li))
    compiled_nb = compiled_checkpoint_moments(items, li, residual, rec_li, **(block_math or {}))
    if eager_nb and (li not in rec_bytes or rc.attention_only) and "recompute_and_work" in parts:
        parts = _uncast_work(parts, s.st.largest.get(li, 0), s.st.largest_uncast.get(li, 0))
    if eager_nb and li in rec_bytes and rc.attention_only and "recompute_and_work" in parts:
        # selective: the attention core recomputes after the block's later nodes released what it saved after its
        # attention (estimate/selective_moments.py)
        parts = {**parts, "activations": parts["activations"] - saved_after_attention(items, li)}
    if compiled_nb and rec_li is not None:  # they model the block's backward (compiled_op_moment.py: a deferred
        parts = {k: v for k, v in parts.items() if k != "recompute_and_work"}  # recompute holds less)
    last = max(blocks)
    for nb in (*eager_nb, *compiled_nb):
        # the first block's attention backward frees what the blocks share (rotary cos/sin:
        # their saved-by-rope references are gone); the embedding keeps its indices
        shared = shared_block_inputs(items) if nb["after_attention"] and li == min(blocks) else 0
        # node_work: the residual gradient, the node's temporaries, and the loss and its seed
        # gradient (ones_like), alive through backward
        # FSDP2 per pipeline stage (estimate/parallel_pp.py fsdp_stage_moments): every earlier gradient is in
        # the unsharded buffer ``working`` counts; the block's new ones are unsharded, not yet accumulated
        at = {**({"gradients": nb["block_gradients"] * rank.fsdp_pp_grads} if rank.fsdp_pp_grads else stored_and_new(
                  grads_before + nb.get("new_gradients", nb.get("accum_new_gradients", 0) if inp.grad_accum > 1
                                        else nb["block_gradients"]), s.G)),
              **held_and_recomputed(acts_before, rec_add, nb["freed_activations"] + shared),
              "node_work": nb["work"] + s.loss_scalars(inp)
              # an eager last block's residual gradient is the received one (pp_recv_gradients); not taken off a
              # checkpointed one's moment: measured, --recompute full and every-k under --pp were one (B, S, H) under
              # the trace on rank 0 with it (its recomputed set's freed block output likely being the stage output,
              # counted apart in pp_stage_outputs: not traced further)
              - (residual if rank.grad_received and li == last and not nb["after_attention"]
                 and li not in rec_bytes and any(nb is e for e in eager_nb) else 0),
              "router_logits_grad": parts.get("router_logits_grad", 0)}
        if sum(at.values()) > sum(parts.values()):
            parts, note = at, (f"{note.split(':')[0].split(', at its')[0]}, at its MLP product's or an RMSNorm's backward: "
                               "gradients so far, the residual gradient and the node's temporaries")
    return parts, note


def _output_released(inp: PhaseInputs, st, li: int) -> int:
    """What checkpointed block ``li`` keeps (``st.act_layer``: its output, the next block's checkpoint input), which
    the next block's backward released before ``li``'s recompute (its first node unpacked it: estimate/block_backward.py
    ``checkpoint_kept``; the node moments take it off too). As ``held_by_norm`` for the last block, whose output the
    final norm's backward released. Tiny GPT-2 amp-bf16 --recompute full B2 S64: the first block's working set held
    it, 16,120 B over the trace (whose top is the block's GELU MulBackward0, a node moment)."""
    rc = inp.recompute
    if li not in rc.per_block or rc.recomputed is None or rc.attention_only:
        return 0
    # Only where the node moments that then decide are modelled (block_backward.node_moments_modelled): with
    # another norm or routed experts the working set stays the bound, the output in it. Without this gate the
    # tiny Gemma, Gemma-3, OLMo-2, Mixtral, Qwen3-MoE, Llama-4 and DeepSeek-V3 read one (B,S,H) further under the
    # trace (fp32 full B2 S64: Gemma −65,544 → −85,504 B), their unmodelled node moments above the working set.
    if not node_moments_modelled(rc.recomputed):
        return 0
    return st.act_layer.get(li, 0)


def _mixed_middle(blocks: set[int], recompute_bytes) -> dict[int, tuple[int, None]]:
    """Under ``--recompute every-k`` (some blocks checkpointed, not all) live bytes are not linear in the block
    index: a checkpointed block's recomputation sits on the eager blocks' saved sets before it, so the ends bound
    nothing and every block between them takes its moment (no gradient correction, the phase's buffers).
    torchtitan's count checkpoints blocks k-1, 2k-1... (ImplSpec.checkpointed): at L=3, k=2 block 1's MLP backward
    is the step's top, the trace's 4,433,224 B, which the ends' moments read 90,112 B under (tiny Llama fp32 B2 S96)."""
    if not recompute_bytes or set(recompute_bytes) >= blocks:
        return {}
    return {li: (0, None) for li in sorted(blocks) if min(blocks) < li < max(blocks)}


def _uncast_work(parts: dict[str, int], largest: int, uncast: int) -> dict[str, int]:
    """The block working set where the block's node moments are read. A linear's autocast weight copy gets its
    gradient from the linear's own node (``MmBackward0``: ``grad.T @ x``, the copy's size), which runs after the
    block output's reader and every later node released their saved tensors (torch/csrc/autograd/engine.cpp,
    ``Node::release_variables``), so that gradient is never beside every block tensor; the MLP's and the first
    input projection's copies have their node and ``ToCopyBackward0`` moments read (block_backward.py
    ``_cast_weight_moment``). The working set holds the gradient of the largest other saved tensor. Tiny Llama /
    Qwen2 h64 F176 amp-bf16 B1 S32: the MLP's 22,528 B copies were taken, 10,096 / 9,584 B over the trace (whose
    top is the loss's forward). Not modelled: the attention's other projections' cast moments (their copies are
    left to the working set's other tensors; the sweeps in tests/estimate/test_peak_gaps.py show no case under)."""
    return {**parts, "recompute_and_work": parts["recompute_and_work"] - largest + uncast}
