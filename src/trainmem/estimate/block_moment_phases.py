"""The backward phases' block moments, for the modules that model a mechanism's own node moments after
``estimate/peak.py`` built the phases (estimate/offload_moments.py, estimate/op_moments.py): the ``backward``
phase (the last block's backward) and ``backward_first_block`` become the larger of their working set and
the moments a module reads for that block."""

from __future__ import annotations

from typing import Callable, Iterable

from trainmem.estimate.phase import Phase
from trainmem.inventory import Category, Inventory, dtype_bytes

__all__ = ["with_block_moments", "gradient_parts", "loss_scalar_bytes"]

#: (block index, the gradients alive before its backward, the phase) -> (parts, where) per moment
Moments = Callable[[int, int, Phase], Iterable[tuple[dict[str, int], str]]]


def gradient_parts(before: int, block_new: int, stored: int) -> dict[str, int]:
    """A moment's gradients, as estimate/peak.py splits them: at most every gradient item (``gradients``),
    beyond them the block's new ones beside their stored ``.grad`` (``new_gradients``, under accumulation)."""
    total = before + block_new
    return {"gradients": min(total, stored), "new_gradients": total - min(total, stored)}


def loss_scalar_bytes(loss: str, loss_dtype: str) -> int:
    """The loss and its seed gradient (``ones_like``), alive through backward under the cross-entropy."""
    return 2 * dtype_bytes(loss_dtype) if loss == "ce" else 0


def with_block_moments(phases: list[Phase], items: Inventory, moments: Moments, *, grad_accum: int,
                       source: str) -> list[Phase]:
    """``phases`` with each block backward phase the larger of itself and ``moments``' parts for its block.
    The gradients before a block's backward, as estimate/peak.py has them: the head's and every later
    block's (the input embedding's are made last); with accumulation every stored ``.grad``."""
    from trainmem.estimate.peak import layer_stats
    st = layer_stats(items)
    if not st.grad_layer:
        return phases
    G = st.by_cat.get(Category.GRADIENT, 0)
    ends = {"backward": max(st.grad_layer), "backward_first_block": min(st.grad_layer)}
    out = []
    for p in phases:
        li = ends.get(p.name)
        best = p
        if li is not None:
            later = sum(v for j, v in st.grad_layer.items() if j > li)
            before = G if grad_accum > 1 else G - sum(st.grad_layer.values()) - st.late_grad + later
            for parts, where in moments(li, before, p):
                parts = {k: v for k, v in parts.items() if v}
                if sum(parts.values()) > best.bytes:
                    best = Phase(p.name, sum(parts.values()), parts,
                                 f"{p.note.split(':')[0]}, at {where}: the gradients so far, the residual gradient, "
                                 f"the node's temporaries ({source})")
        out.append(best)
    return out
