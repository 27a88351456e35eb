"""The gradient items of the input and output tables, found by their shared names (trainmem/names.py).

One lookup for the three readers that need them: the compiled embedding backward's tables
(estimate/compiled_embedding_backward.py, which reads the shape and dtype), gradient accumulation's new
embedding gradient (estimate/grad_accum.py) and the head's weight gradient (estimate/peak.py).
"""

from __future__ import annotations

from trainmem.inventory import Category, Inventory, MemoryItem
from trainmem.names import is_token_embedding

__all__ = ["base_items", "token_embedding_grad", "head_weight_grad"]


def base_items(items) -> list[MemoryItem]:
    """The items of ``items`` (an Inventory's base items, or a list as it is)."""
    return list(items.base) if isinstance(items, Inventory) else list(items)


def token_embedding_grad(items) -> MemoryItem | None:
    """The token embedding's weight gradient (the largest gradient under it), ``None`` when it has none (frozen)."""
    grads = [i for i in base_items(items) if i.category is Category.GRADIENT and is_token_embedding(i.name)]
    return max(grads, key=lambda i: i.bytes, default=None)


def head_weight_grad(items) -> MemoryItem | None:
    """The output layer's weight gradient: ``lm_head``'s, or the token embedding's when the head has no parameter
    of its own (tied; not a larger position table's, GPT-2's ``wpe`` at V 128). ``None`` when that weight is frozen."""
    base = base_items(items)
    head = [i for i in base if i.category is Category.GRADIENT and i.name.startswith("lm_head.")]
    if head or any(i.category is Category.PARAMETER and i.name.startswith("lm_head.") for i in base):
        return max(head, key=lambda i: i.bytes, default=None)
    return token_embedding_grad(base)
