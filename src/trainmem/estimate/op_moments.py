"""Eager ``--recompute op``: a checkpointed block's backward node moments on its recomputed set.

torchtitan's op policy runs each block under the non-reentrant ``torch.utils.checkpoint`` with
``context_fn`` = ``create_selective_checkpoint_contexts`` (torch/utils/checkpoint.py). In forward,
``_CachingTorchDispatchMode`` stores the outputs the policy saves (every other ``mm``, ...: docs/recompute.md)
in a storage the two modes share. In backward, the block's first unpack (``_checkpoint_hook``'s unpack hook)
reruns its forward. There ``_CachedTorchDispatchMode`` hands each saved output back from that storage
(popped), so the rerun rebuilds the block's plain saved set (what it keeps without recompute) with no second
copy of a cached output. Which means, at a node of the block's backward:

* the block's saved set is the plain one (``plain``: the inventory without recompute), less what the
  block's nodes freed by then (estimate/block_backward.py ``norm_backward_parts``, read on it);
* a cached output the rerun popped and that nothing saves (the query projection's output before the rotary
  product) died in the rerun; one the plain set saves too (the gate projection's output, the value
  projection's, which SDPA's ``v`` views) is counted once there;
* the rerun stops as soon as the last tensor the block's backward needs is saved (``_StopRecomputationError``,
  ``early_stop``). Llama's last is the down projection's input, packed by the projection's own ``mm`` before
  it runs: its output, cached, is never popped and stays in the storage through the block's backward. In
  the inventory: the kept outputs that the plain set lacks, after the block's last kept output that the
  plain set has; none when a dropout's mask after the projection is the last (GPT-2's MLP);
* the block's output, kept as the next checkpoint's input (not a plain saved tensor under 16-bit norms, which
  save their fp32 copy), was released by the next block's backward.

The phases (estimate/peak.py) take no node moments for an eager op block (its ``recompute_and_work`` bound
instead), which fell short of the MLP product's ``MulBackward0``. Tiny Llama (h64, 2 layers, V256, B1 S64):
bf16 971,584 B against 983,880 B traced, fp32 1,891,392 B against 1,915,976 B.
"""

from __future__ import annotations

from trainmem.estimate.block_backward import block_items, norm_backward_parts
from trainmem.estimate.block_moment_phases import gradient_parts, loss_scalar_bytes, with_block_moments
from trainmem.estimate.phase import Phase
from trainmem.inventory import Category, Inventory
from trainmem.names import split_block

__all__ = ["with_op_moments"]

_REPLACED = ("gradients", "new_gradients", "activations", "recompute_and_work", "recomputed", "node_work")


def _is_residual(name: str) -> bool:
    """A block's residual sum (``residual_attn``, ``residual_mlp``): the block's own tensors, never an op's cache."""
    parts = split_block(name)
    return bool(parts) and parts[2].startswith("residual")


def _block_swap(items: Inventory, plain: Inventory, li: int) -> int:
    """What block ``li`` holds at its backward beyond its kept set: its plain saved set plus the cached outputs
    the rerun never reached, less its kept set (the module docstring)."""
    kept = [i for i in block_items(items, li) if i.category is Category.ACTIVATION and i.bytes]
    saved = [i for i in block_items(plain, li) if i.category is Category.ACTIVATION and i.bytes]
    names = {i.name for i in saved}
    stop = max((k for k, i in enumerate(kept) if i.name in names and not _is_residual(i.name)), default=-1)
    unreached = sum(i.bytes for i in kept[stop + 1:] if i.name not in names and not _is_residual(i.name))
    last = next((i for i in reversed(saved) if not _is_residual(i.name)), None)
    if last is not None and last.name.endswith(".mask"):  # a dropout after the down projection (GPT-2's) saves its
        unreached = 0  # mask: the rerun ran through the projection, whose cached output it popped
    return sum(i.bytes for i in saved) + unreached - sum(i.bytes for i in kept)


def _kept_only(items: Inventory, plain: Inventory, li: int) -> int:
    """Block ``li``'s kept outputs the plain set lacks: ``norm_backward_parts`` counts them as freed for a block
    before the last (``checkpoint_kept``); here :func:`_block_swap` accounts for them."""
    names = {i.name for i in block_items(plain, li) if i.category is Category.ACTIVATION and i.bytes}
    return sum(i.bytes for i in block_items(items, li) if i.category is Category.ACTIVATION and i.bytes
               and i.name not in names)


def with_op_moments(phases: list[Phase], items: Inventory, plain: Inventory, *, residual_bytes: int, loss: str,
                    loss_dtype: str, grad_accum: int) -> list[Phase]:
    """``phases`` whose block backward phases are the larger of their working set and the block's node moments
    on its recomputed set (estimate/block_moment_phases.py). ``items``: the step's inventory (states and the
    op-level kept set); ``plain``: the activation inventory without recompute."""
    from trainmem.estimate.peak import layer_stats
    st = layer_stats(items)
    G, A = st.by_cat.get(Category.GRADIENT, 0), st.by_cat.get(Category.ACTIVATION, 0)
    top = max((*st.act_layer, *st.grad_layer), default=-1)  # the last block, as checkpoint_kept reads it
    scalars = loss_scalar_bytes(loss, loss_dtype)

    def moments(li: int, before: int, p: Phase):
        held = A - st.head_act - sum(v for j, v in st.act_layer.items() if j > li) + _block_swap(items, plain, li)
        held += _kept_only(items, plain, li) if li < top else 0
        base = {k: v for k, v in p.parts.items() if k not in _REPLACED}
        for nb in norm_backward_parts(items, li, residual_bytes, plain):
            new = nb.get("new_gradients", nb.get("accum_new_gradients", 0)) if grad_accum > 1 else nb["block_gradients"]
            yield ({**base, **gradient_parts(before, new, G), "activations": held - nb["freed_activations"],
                    "node_work": nb["work"] + scalars}, "a node of its recomputed block")

    return with_block_moments(phases, items, moments, grad_accum=grad_accum,
                              source="op-level checkpointing: the plain saved set and the cached outputs the rerun "
                                     "never reached, estimate/op_moments.py")
