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


def math_core_moments(items: "Inventory | list[MemoryItem]", li: int, *, kernel: str | None, residual_bytes: int,
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

    ``kernel``: the kernel the step's cores run (``PhaseInputs.attention_kernel``, estimate/attention.py
    ``kernel_for``): only ``"math"`` has this moment (eager keeps transformers' own matmuls and mask, the fused
    kernels no (B, A, S, S) score). The core's K/V checkpoint inputs (the (B, A, S, hd) items under the attention
    module) give the heads' size and the input dtype, the block's recomputed set (``recomputed``:
    estimate/layer_stats.py ``recompute_per_layer``) its saved bytes; SDPA gets ``is_causal`` (modeling_gpt2.py
    ``GPT2Attention.forward``, integrations/sdpa_attention.py ``sdpa_attention_forward``). Tiny GPT-2 (h64,
    4 heads, 2 layers, V128, attention dropout 0.1, so CPU SDPA runs math) amp-bf16 B2 S64: the trace's top,
    3,166,216 B, is this moment in block 1 (tests/estimate/test_selective_moments.py).

    Llama (q after RoPE, K/V at Akv heads, :func:`_core_inputs`): ``enable_gqa`` repeats key_acc and value_acc
    (``repeat_interleave``, fp32 (B, A, S, hd) copies: the repeated V is the saved one), amp's autocast casts the
    fp32 q and k to bf16 first, and with no dropout the top is earlier, at the additive mask's ``add`` (the
    fp32 score and its masked copy beside the saved q, kᵀ and V), or in fp32 at the core's own backward
    (``_softmax_backward_data``: the saved q, kᵀ and softmax, V's gradient, dP and dS). Tiny Llama (h64, 4/2
    heads) ``--attention sdpa-math`` selective bf16 / amp-bf16 B2 S64: 1,768,648 / 2,848,072 B, the add's moment
    in block 1 (tests/estimate/test_selective_moments.py).

    With dropout (GPT-2) the core's backward starts beside dropout's mask and output, still saved: at P·V's
    ``BmmBackward0`` (below); tiny GPT-2 selective S128 tops there at every precision.

    Known limitations: an explicit mask and a q that is not a view (GPT-NeoX's rotated q) are not checked on a
    trace and get no moment."""
    if recomputed is None or kernel != "math":
        return []
    block = [i for i in block_items(items, li) if i.category is Category.ACTIVATION and i.bytes]
    core = _core_inputs(items, block)
    if core is None:
        return []
    first, last, dtype, cast, (B, A, Akv, S, hd), v_cached = core
    h32, kv32, score32 = B * A * S * hd * 4, B * Akv * S * hd * 4, B * A * S * S * 4
    upcast, gqa = dtype != "float32", Akv != A
    # the recomputed set is read off the blocks without a KV cache (estimate/__init__.py ``plain``), where GPT-2's
    # V is a strided view of c_attn's output that matmul copies at B > 1 (``v_repeat``); the selective step reads
    # V from the cache's contiguous cat, whose (B·A, S, hd) reshape is a view: in fp32 (value_acc is V) no copy
    saved = recomputed[0] - (h32 if v_cached and not upcast and B > 1 else 0)
    common = (residual_bytes + h32  # the residual gradient and the core output's fp32 gradient
              + cast  # autocast's 16-bit copies of fp32 inputs (amp: Llama's RoPE'd q and k), SDPA's arguments
              + S * S * 4  # the causal mask, additive fp32
              # query_acc and key_acc; value_acc too under GQA (else the saved V is value_acc)
              + (h32 + kv32 + (kv32 if gqa else 0) if upcast else 0)
              + (h32 if gqa else 0)  # enable_gqa: key_acc's repeat_interleave (value_acc's is the saved V)
              + (h32 if B > 1 and not _rope_by_cat(items, li) else 0))  # the scaled q before matmul's reshape copied it
    # the top at the end: the recomputed saved set (q and kᵀ scaled, softmax, dropout's mask and output, the V)
    # and the weights' 16-bit cast; or at the mask's add, before the softmax: the saved q, kᵀ and V beside the
    # fp32 score and its masked copy (no dropout: tiny Llama's top)
    work = common + max(saved + (B * A * S * S * dtype_bytes(dtype) if upcast else 0), 3 * h32 + 2 * score32)
    # then the core's own backward: at softmax's backward the kernel's locals are gone, the residual gradient
    # beside the saved q and kᵀ, the softmax, V's gradient (its repeat not yet summed) and the score's two
    # gradients (dP, dS); tiny Llama fp32 B1 S64 tops here (16,384 B under it before)
    work = max(work, residual_bytes + 3 * h32 + 3 * score32)
    # the core's first backward node, P·V's ``BmmBackward0``: beside the whole recomputed saved set (the dropout
    # mask and output too: softmax's and dropout's nodes run later) the output's gradient as bmm reads it, a
    # contiguous fp32 (B·A, S, hd) (matmul's reshape copies the transposed gradient at B > 1; at B == 1 it is
    # c_proj's mm output), V's gradient (A heads) and then P's, (B·A, S, S) fp32, allocated second (the trace's
    # ``bmm:3`` then ``bmm:4``). Tiny GPT-2 fp32 / bf16 / amp-bf16 B2 S128 and fp32 B1 S128 top here
    # (-83,976 / -65,536 / -65,536 / -149,512 B under before: tests/estimate/test_selective_moments.py)
    work = max(work, residual_bytes + h32 + saved + h32 + score32)
    after = block[last + 1:]
    # the block's gradients but those of the modules that ran before the core (the input norm, the QKV projection
    # and its adapters), whose nodes run after it; paths inside the block (a template's gradients keep block 0's names)
    before = {_inside(i.name).rsplit(".", 1)[0] + "." for i in block[:first]}
    grads = [i for i in block_items(items, li) if i.category is Category.GRADIENT
             and not any(_module(_inside(i.name)).startswith(b) for b in before)
             and not any(p in _inside(i.name) for p in _QKV)]
    return [{"block_gradients": sum(i.bytes for i in grads), "freed_activations": sum(i.bytes for i in after),
             "after_attention": 0, "work": work}]


# the families' Q/K/V projections, separate (modeling_llama.py ``LlamaAttention``) or fused (modeling_phi3.py
# ``Phi3Attention.qkv_proj``), whose nodes run after the core's
_QKV = (".q_proj.", ".k_proj.", ".v_proj.", ".qkv_proj.")


#: the fused Q/K/V projection of Phi-3, whose RoPE ends in ``torch.cat`` (modeling_phi3.py ``apply_rotary_pos_emb``:
#: ``cat([rotated, q_pass], dim=-1)``): q reaches SDPA as a fresh contiguous (B, A, S, hd) tensor, so the math kernel's
#: scaled q folds into bmm's (B·A, S, hd) batch as a view, no copy (the rules' ``out_copy=rules.fused_qkv``,
#: estimate/rules_hf.py ``_llama_attention``, reads the same layout for the fused kernels)
_CAT_ROPE = (".self_attn.qkv_proj.",)


def _rope_by_cat(items, li: int) -> bool:
    """Block ``li``'s q comes out of a RoPE that ends in ``torch.cat`` (:data:`_CAT_ROPE`). Tiny Phi-3 (h64, 4 heads,
    attention dropout 0.1) amp-bf16 --recompute selective B2 S64: the copy read 32,768 B over the trace."""
    return any(p in i.name for i in block_items(items, li) for p in _CAT_ROPE)


def _core_inputs(items, block: list[MemoryItem]) -> "tuple[int, int, str, int, tuple[int, ...], bool] | None":
    """The core's checkpoint inputs in block ``block``'s activations: the index of the first and of the last, the
    kernel's input dtype (V's), the bytes of autocast's casts of inputs in another dtype to it, (B, heads,
    K/V heads, S, head_dim), and whether K/V are the KV cache's contiguous (B, A, S, hd) copies (GPT-2); None for
    a layout not checked on a trace.

    GPT-2: two (B, A, S, hd) K/V items, q a strided view of c_attn's output (no item). Llama: q after RoPE
    (B, S, A·hd) and K/V (B, S, Akv·hd), handed to SDPA as (B, heads, S, hd) transposes with ``enable_gqa`` when
    Akv < A (transformers integrations/sdpa_attention.py ``use_gqa_in_sdpa``: no repeat_kv), head_dim read off
    RoPE's (1, S, hd) cos. GPT-NeoX's rotated q is a (B, A, S, hd) tensor of its own (a third such item): not
    checked, and 18,440 B over its trace at bf16 B2 S64."""
    attn = [k for k, i in enumerate(block) if any(a in i.name for a in _ATTENTION)]
    heads = [k for k in attn if block[k].dims == _HEADS]
    if len(heads) == 2:
        B, A, S, hd = block[heads[-1]].shape
        return heads[0], heads[-1], block[heads[-1]].dtype, 0, (B, A, A, S, hd), True
    # the projections' weight casts (amp, bf16 LoRA) are items under the attention module too
    qs = [k for k in attn if block[k].dims == ("B", "S", "A·hd")]
    kvs = [k for k in attn if block[k].dims == ("B", "S", "Akv·hd")]
    hds = {i.shape[-1] for i in items if i.dims == ("1", "S", "hd")}
    if len(kvs) != 2 or not qs or qs[0] > kvs[0] or len(hds) != 1:
        return None
    (hd,), q, kv, v = hds, block[qs[0]], block[kvs[0]], block[kvs[1]]
    B, S, qw = q.shape
    # amp: RoPE ran in fp32 (q and k fp32, V bf16); autocast casts SDPA's fp32 arguments to bf16 (a lower-
    # precision op: aten/src/ATen/autocast_mode.cpp), copies alive until the kernel returns
    cast = sum(i.bytes // dtype_bytes(i.dtype) * dtype_bytes(v.dtype) for i in (q, kv) if i.dtype != v.dtype)
    return qs[0], kvs[1], v.dtype, cast, (B, qw // hd, kv.shape[-1] // hd, S, hd), False


def _module(grad: str) -> str:
    """``<module>.`` of a gradient item (``<module>.<parameter>.grad``)."""
    return grad.removesuffix(".grad").rsplit(".", 1)[0] + "."


def _inside(name: str) -> str:
    """The path inside its block (``transformer.h.1.attn.c_proj.weight_cast`` -> ``attn.c_proj.weight_cast``)."""
    return split_block(name)[2]
