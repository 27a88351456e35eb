"""``--cp N --cp-style ring``: the moments inside a block where torch's ring attention holds its buffers
(their sizes: estimate/context_parallel.py). The ring runs inside each attention call, forward and backward,
and its buffers are gone when the call returns, so each is a moment of its own in the phases (peak.py): the
backward one a node moment of each block's backward (:func:`ring_attention_moments`), the forward one inside
the last block's attention (:func:`ring_forward_held`), which tops the forward when the blocks keep little
(``--recompute full``). Both per rank class (``RingBuffers``): the ranks that keep the merged output's copy,
and the last rank, which keeps none. Checked to the byte against torch's own ring on fake tensors
(tests/parallel/test_cp_ring_backward.py).
"""

from __future__ import annotations

from trainmem.estimate.block_backward import block_items, checkpoint_kept
from trainmem.inventory import Category

__all__ = ["ring_attention_moments", "ring_forward_held", "before_the_head"]

#: an attention child's output projection, whose backward runs just before the attention's own
_OUTPUT_PROJECTIONS = ("o_proj",)  # checked for transformers' Llama (tests/parallel/test_cp_ring_backward.py)


def ring_attention_moments(items, li: int, residual_bytes: int, ring, recomputed=None) -> list[dict[str, int]]:
    """Block ``li``'s attention backward under the ring (``_scaled_dot_product_ring_flash_attention_backward``,
    torch/distributed/tensor/experimental/_context_parallel/_attention.py), as node moments in
    block_backward.py's form (with ``where``, the phase note's end), one per rank class (``ring``: ``RingBuffers``
    or ``None``). The output
    projection's backward has run (its weight gradient made, its saved input, the merged output's copy,
    released), and so has every child after the attention (their gradients made, their saved tensors
    released: torch/csrc/autograd/engine.cpp, ``Node::release_variables``); the kernel's own saved set (q, k, v,
    output, log-sum-exp) is what the ring reads. Alive besides: the residual gradient, the output projection's
    input gradient (the kernel output's size and dtype) and the ring's buffers above its entry. The last rank
    holds no earlier block's merged-output copy (:func:`_copies`). ``recomputed``: the inventory without
    checkpointing, whose block tensors a checkpointed block recomputed (``--recompute full``). Empty without a
    ring or where the block's attention is not recognised (no flash log-sum-exp or output projection)."""
    if not ring:
        return []
    block = block_items(items, li)
    acts = [i for i in (block_items(recomputed, li) if recomputed is not None else block)
            if i.category is Category.ACTIVATION and i.bytes]
    lse = next((k for k, i in enumerate(acts) if i.name.endswith(".lse")), None)
    out = next((i for i in acts if i.name.endswith(".sdpa_out")), None)
    if lse is None or out is None:
        return []
    attention = acts[lse].name.rsplit(".", 1)[0]  # model.layers.{li}.self_attn
    grads = [i for i in block if i.category is Category.GRADIENT]
    proj = [i for i in grads if any(i.name.startswith(f"{attention}.{p}.") for p in _OUTPUT_PROJECTIONS)]
    if not proj:
        return []
    later = {_child(i.name) for i in acts[lse + 1:]} - {_child(attention + ".")}  # the children run after it
    made = sum(i.bytes for i in proj) + sum(i.bytes for i in grads if _child(i.name) in later)
    freed = sum(i.bytes for i in acts[lse + 1:]) + (checkpoint_kept(items, li, acts) if recomputed is not None else 0)
    # ring attention's backward: gradients so far, the residual gradient, o_proj's input gradient and the ring's buffers
    at = {"block_gradients": made, "freed_activations": freed, "after_attention": 0}
    return [{**at, "work": residual_bytes + out.bytes + ring.backward[0]},
            {**at, "freed_activations": freed + _copies(items, li, grads, attention),
             "work": residual_bytes + out.bytes + ring.backward[1]}]


def ring_forward_held(items, last: int, earlier: int, ring, recomputed=None) -> dict[str, int] | None:
    """Block ``last``'s ring attention forward (``_templated_ring_attention`` and ``_SDPAMerger``, the fp32 merge
    of each ring step's output): the activations alive at its entry and the ring's bytes above it, the worst
    rank class's, as phase parts. Alive: what the blocks before it and the embedding and rotary tables keep
    (``earlier``), and the block's own tensors before its attention output: kept ones, or, in a checkpointed
    block (``recomputed``: the inventory without checkpointing), the decoder layer's locals, its input norm's
    output and the attention's q, k and v (the norm's internals were freed with its frame: nothing saves them).
    ``None`` without a ring, or where the block is not recognised (no flash output, or no norm output before q, k, v)."""
    if not ring:
        return None
    block = block_items(items, last)
    own = _before_output([i for i in block if i.category is Category.ACTIVATION])
    if own is None:  # checkpointed: its locals, from the set it would keep
        plain = [i for i in block_items(recomputed, last) if i.category is Category.ACTIVATION and i.bytes] \
            if recomputed is not None else []
        before = _before_output(plain)
        if before is None or len(before) < 4 or not before[-4].name.endswith("norm.out"):
            return None
        own = before[-4:]  # the norm's output, then q, k, v as the kernel takes them
        block = block + plain
    attention = next(i.name.rsplit(".", 1)[0] for i in block if i.name.endswith(".sdpa_out"))
    held = earlier + sum(i.bytes for i in own)
    without = held - _copies(items, last, [i for i in block if i.category is Category.GRADIENT], attention)
    if held + ring.forward[0] >= without + ring.forward[1]:
        return {"activations": held, "cp_ring_forward": ring.forward[0]}
    return {"activations": without, "cp_ring_forward": ring.forward[1]}


#: the forward phase's extras (estimate/forward_held.py) made after the blocks, at the head and the loss
_AFTER_BLOCKS = ("padded_labels", "head_input_unsaved")


def before_the_head(forward: dict[str, int]) -> dict[str, int]:
    """The forward phase's buffers and extras alive inside the blocks (:func:`ring_forward_held`'s moment): all but
    those the head and the loss make (ForCausalLMLoss's padded labels: B 2, cp 2, 528 B, measured)."""
    return {k: v for k, v in forward.items() if k not in _AFTER_BLOCKS}


def _before_output(acts: list) -> list | None:
    """A block's activations before its attention kernel's output (``sdpa_out``), or ``None`` without one."""
    at = next((k for k, i in enumerate(acts) if i.name.endswith(".sdpa_out")), None)
    return None if at is None else acts[:at]


def _copies(items, li: int, grads: list, attention: str) -> int:
    """The merged-output copies (``attn_out`` beside ``sdpa_out``) the blocks before ``li`` keep on every rank
    but the last; none where the input projections are fused: that copy is made on every rank (rules_hf.py
    ``out_copy``)."""
    if any(i.name.startswith(f"{attention}.qkv_proj.") for i in grads):
        return 0
    return sum(i.bytes for j in range(li) for i in block_items(items, j)
               if i.category is Category.ACTIVATION and i.name.endswith(".attn_out"))


def _child(name: str) -> str:
    """The block's child ``name`` belongs to (``self_attn`` for ``model.layers.1.self_attn.o_proj.weight``)."""
    return name.split(".", 3)[-1].split(".", 1)[0]
