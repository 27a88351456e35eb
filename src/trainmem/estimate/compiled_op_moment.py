"""The backward moment of a block compiled around torchtitan's op-level checkpoint (``--compile --recompute op``).

torchtitan's op-level policy (``estimate/graph.py`` ``OpPolicy``) tags every op of the block: ``MUST_SAVE`` for
its 1st, 3rd, 5th... mm (and every addmm), ``PREFER_RECOMPUTE`` for the rest. Under compile the tags become node
metadata the partitioner obeys: ``torch/_functorch/partitioners.py`` ``must_recompute`` counts
``PREFER_RECOMPUTE`` with ``MUST_RECOMPUTE`` (recomputed whatever the min-cut would say) and
``solve_min_cut``'s ``should_ban_recomputation`` bans recomputing ``MUST_SAVE`` nodes. So the backward graph of
the block re-runs every forward value but the saved mm outputs, as under ``--recompute full``, and holds each
value its backward reads until that read: the moments of the fully checkpointed block
(``estimate/compiled_recompute.py`` ``compiled_checkpoint_moments``, run on the block's compiled saved set
without checkpointing). Where a saved mm output is the very tensor the compiled set holds (v, the gate, up) it
is held once; where the compiled set holds a value made from it (q and k roped: ``self_attn.q_rope``), the saved
output is read by that recompute only and freed before the MLP's backward (:func:`replaced_by_recompute`).

Read off the trace (``trace --compile --compile-scope block --recompute op``, the partitioned graphs run op by
op): tiny Llama (H 64, F 176, 4/2 heads, V 256, untied), AdamW, B 2 S 64, the peak is the first block's MLP
backward, at the same bytes as ``--recompute full``: bf16 1,503,560 B (SiLU's backward), fp32 2,589,256 B (the
product's); before this moment the estimate read 0.923 and 0.968 of them
(tests/estimate/test_compiled_op_moment.py).
"""

from __future__ import annotations

from trainmem.estimate.block_backward import block_items
from trainmem.inventory import Category, Inventory, MemoryItem
from trainmem.names import split_block
from trainmem.specs import ImplSpec

__all__ = ["recomputes_blocks", "op_block_freed"]

# a policy that saves o_proj's output, or the SDPA output it is made from, defers the attention's recompute
_SAVED_O = "self_attn.o_proj.out"
_DEFERS = (_SAVED_O, "self_attn.sdpa_out")
_INPUT_NORM = ("input_layernorm.rsqrt", "input_layernorm.out")


def recomputes_blocks(impl: ImplSpec) -> bool:
    """Whether a checkpointed block's backward moments run on its recomputed set (``peak.phases``'s
    ``recomputed``): ``--recompute full``, and op-level checkpointing inside a compiled block (eager op-level
    checkpointing keeps its saved outputs beside the recomputed ones: ``peak.recompute_per_layer``)."""
    return impl.recompute == "full" or (impl.compile and impl.recompute == "op")


def op_block_freed(items: "Inventory | list[MemoryItem]", last: int, kept: dict[str, MemoryItem], norm_held: int,
                   block_input: int) -> int:
    """What block ``last``'s MLP moments hold less than a fully checkpointed block's
    (``compiled_recompute.compiled_checkpoint_moments``, whose ``kept`` is the block's compiled set by path inside
    the block, ``norm_held`` what each recomputed RMSNorm holds beyond it, ``block_input`` the checkpoint's input
    it frees). 0 for a fully checkpointed block, which saves its input alone. Under op-level checkpointing:

    * the attention is recomputed (o_proj's output not saved): the saved activations the compiled set does not
      hold, read by the recompute alone (the q and k projections before the rotary), were freed;
    * o_proj's output saved (its mm is one the policy keeps, or q/k/v are addmm): the residual sum is recomputed
      from it and the block input, the attention is not yet: the input norm's recomputed values and the
      attention's compiled set beyond what the policy saved are not held, and the block input is not freed."""
    own = {_inner(i.name): i for i in block_items(items, last) if i.category is Category.ACTIVATION}
    if not any(n in own for n in _DEFERS):
        return sum(i.bytes for n, i in own.items() if n not in kept)
    # o_proj's output, recomputed from the saved SDPA output, is freed by the residual sum (counted there)
    attention = sum(i.bytes for n, i in kept.items() if n.startswith("self_attn.") and n not in own and n != _SAVED_O)
    return norm_held + sum(kept[n].bytes for n in _INPUT_NORM) + attention - block_input


def _inner(name: str) -> str:
    parts = split_block(name)
    return parts[2] if parts else name
