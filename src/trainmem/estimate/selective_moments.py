"""``--recompute selective``: what a block has released when its attention core is recomputed.

Selective recompute checkpoints the attention core alone (trace/recompute.py ``selective_recompute``: a
non-reentrant ``torch.utils.checkpoint`` around transformers' attention function), and the checkpoint recomputes
when the core's backward node first unpacks a saved tensor. Autograd runs the block's later nodes first: the
MLP's, the post-attention norm's, the block output's, each releasing its saved tensors as it finishes
(``torch/csrc/autograd/engine.cpp``, ``Node::release_variables``), GPT-NeoX's parallel residual included (its MLP
branch's nodes run before the attention's, as the traces show). So the core's recomputed tensors and working set
are never beside the block's tensors saved after its attention; the phase's generic working set
(estimate/backward_moments.py, ``recompute_and_work``) counted them together, over by those bytes.

Tiny GPT-NeoX (h128, F512, V128, 2 layers) fp32 B1 S32 --recompute selective: the working set read 2,215,200 B, the
trace's attention backward 2,067,752 B and its top 2,182,184 B (the frozen MLP's GELU backward, a node moment:
estimate/block_backward.py); less the 82,176 B saved after block 1's attention the working set is 2,133,024 B,
still above the attention's moment, and the node moment decides
(``tests/estimate/test_selective_moments.py``).
"""

from __future__ import annotations

from trainmem.estimate.block_backward import block_items
from trainmem.inventory import Category, Inventory, MemoryItem

__all__ = ["saved_after_attention"]

_ATTENTION = (".self_attn.", ".attention.", ".attn.")  # the attention module of the families' blocks


def saved_after_attention(items: "Inventory | list[MemoryItem]", last: int) -> int:
    """Bytes block ``last`` saves after its attention's last saved tensor (in inventory order: the post-attention
    norm's, the MLP's, the block's outputs), all released before its attention core's backward runs; 0 when the
    block saves nothing under an attention module."""
    acts = [i for i in block_items(items, last) if i.category is Category.ACTIVATION and i.bytes]
    at = max((k for k, i in enumerate(acts) if any(a in i.name for a in _ATTENTION)), default=None)
    return 0 if at is None else sum(i.bytes for i in acts[at + 1:])
