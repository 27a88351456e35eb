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
from trainmem.inventory import Category, Inventory, MemoryItem, dtype_bytes
from trainmem.names import split_block

__all__ = ["saved_after_attention", "math_core_moments"]

_ATTENTION = (".self_attn.", ".attention.", ".attn.")  # the attention module of the families' blocks


def saved_after_attention(items: "Inventory | list[MemoryItem]", last: int) -> int:
    """Bytes block ``last`` saves after its attention's last saved tensor (in inventory order: the post-attention
    norm's, the MLP's, the block's outputs), all released before its attention core's backward runs; 0 when the
    block saves nothing under an attention module."""
    acts = [i for i in block_items(items, last) if i.category is Category.ACTIVATION and i.bytes]
    at = max((k for k, i in enumerate(acts) if any(a in i.name for a in _ATTENTION)), default=None)
    return 0 if at is None else sum(i.bytes for i in acts[at + 1:])


_HEADS = ("B", "A", "S", "hd")  # a (B, heads, S, head_dim) tensor as it reaches the kernel


def math_core_moments(items: "Inventory | list[MemoryItem]", li: int, *, batch: int, seq: int, residual_bytes: int,
                      recomputed: tuple[int, int] | None) -> list[dict[str, int]]:
    """Block ``li``'s attention core recomputed on SDPA's math kernel under ``--recompute selective``: one node
    moment (estimate/backward_moments.py ``_inside``), or none where the core is not that kernel's.

    ``_scaled_dot_product_attention_math`` (aten/src/ATen/native/transformers/attention.cpp) upcasts 16-bit
    q, k, v to fp32 (``query_acc``/``key_acc``/``value_acc``, C++ locals alive until it returns), scales q and
    kᵀ, builds the causal mask itself when SDPA gets ``is_causal`` (``ones(L, S).tril()`` as an additive fp32
    (S, S) mask), takes ``_safe_softmax`` and dropout (``empty_like(...).bernoulli_`` mask, then the product),
    and returns ``make_tuple(matmul(attn, value_acc).to(origin), attn.to(origin))``, whose arguments GCC
    evaluates right to left: the (B, A, S, S) cast of the weights comes first. The checkpoint stops recomputing
    once every saved tensor is back (torch/utils/checkpoint.py, early stop): the P·V bmm packs ``attn`` and
    ``value_acc`` before it allocates its output, so the top is that cast, beside the core output's fp32
    gradient (``ToCopyBackward0`` of the output cast, or the (B·A, S, hd) copy bmm's reshape makes of it),
    the residual stream's gradient, the block's later gradients, and the activations less what the block saved
    after the core (its nodes ran first: :func:`saved_after_attention`'s order, the output projection's too).
    At B > 1 matmul's (B·A, S, hd) reshape copies the scaled q when q is a strided view (GPT-2's split of the
    fused c_attn output: the scaled q keeps its (B, S, A, hd) layout), and the scaled q stays a local.

    Read off the selective inventory: the core's K/V checkpoint inputs (the (B, A, S, hd) items under the
    attention module) give the heads' size and the input dtype; the block's recomputed set (``recomputed``:
    estimate/layer_stats.py ``recompute_per_layer``, its bytes) must hold the scaled q and kᵀ and an fp32
    (B, A, S, S) score (eager and math materialize one, the fused kernels none) and no causal mask may be held (transformers hands eager a
    (B, 1, S, S) mask, which the checkpoint holds; SDPA gets ``is_causal``: modeling_gpt2.py
    ``GPT2Attention.forward``, integrations/sdpa_attention.py ``sdpa_attention_forward``). Tiny GPT-2 (h64,
    4 heads, 2 layers, V128, attention dropout 0.1, so CPU SDPA runs math: estimate/attention.py
    ``resolve_kernel``) amp-bf16 B2 S64: the trace's top, 3,166,216 B, is this moment in block 1
    (tests/estimate/test_selective_moments.py).

    Known limitations: an explicit mask, GQA's expanded K/V and a q that is not a view (GPT-NeoX's rotated q)
    are not checked on a trace and get no moment. In fp32 (no upcast, ``value_acc`` is the held V) the moment
    is below the core's own backward after the recompute (tiny GPT-2 B2 S64: 81,920 B under that node's top,
    B1 S32 20,480 B), which is not modelled; the MLP's moment is the step's top there."""
    if recomputed is None:
        return []
    block = [i for i in block_items(items, li) if i.category is Category.ACTIVATION and i.bytes]
    kv = [k for k, i in enumerate(block) if i.dims == _HEADS and any(a in i.name for a in _ATTENTION)]
    # q a strided view (GPT-2's split of c_attn's output), K/V the cache's copies: the checked layout. GPT-NeoX's
    # rotated q is a tensor of its own (a third such item): not checked, and 18,440 B over its trace at bf16 B2 S64
    if len(kv) != 2 or any(i.dims[-2:] == ("S", "S") for i in items if i.category is Category.ACTIVATION):
        return []
    heads = block[kv[-1]]
    B, A, S, hd = heads.shape
    saved = recomputed[0]
    h32 = B * A * S * hd * 4
    # the scaled q and kᵀ in fp32 and at least one fp32 score: a fused kernel keeps q, k, v, its output and a
    # (B, A, S) log-sum-exp, less than that
    if (B, S) != (batch, seq) or saved < 2 * h32 + B * A * S * S * 4:
        return []
    upcast = heads.dtype != "float32"
    work = (residual_bytes + h32  # the residual gradient and the core output's fp32 gradient
            + saved  # the recomputed saved set (q and kᵀ scaled, softmax, dropout's mask and output, value_acc)
            + S * S * 4  # the causal mask, additive fp32
            + (2 * h32 + B * A * S * S * dtype_bytes(heads.dtype) if upcast else 0)  # query_acc, key_acc; attn cast
            + (h32 if B > 1 else 0))  # the scaled q before matmul's reshape copied it
    after = block[kv[-1] + 1:]
    # the block's gradients but those of the modules that ran before the core (the input norm, the QKV projection
    # and its adapters), whose nodes run after it; paths inside the block (a template's gradients keep block 0's names)
    before = {_inside(i.name).rsplit(".", 1)[0] + "." for i in block[:kv[0]]}
    grads = [i for i in block_items(items, li) if i.category is Category.GRADIENT
             and not any(_module(_inside(i.name)).startswith(b) for b in before)]
    return [{"block_gradients": sum(i.bytes for i in grads), "freed_activations": sum(i.bytes for i in after),
             "after_attention": 0, "work": work}]


def _module(grad: str) -> str:
    """``<module>.`` of a gradient item (``<module>.<parameter>.grad``)."""
    return grad.removesuffix(".grad").rsplit(".", 1)[0] + "."


def _inside(name: str) -> str:
    """The path inside its block (``transformer.h.1.attn.c_proj.weight_cast`` -> ``attn.c_proj.weight_cast``)."""
    return split_block(name)[2]
