"""The ``hf`` rules for DeepSeek-V2 and V3 (transformers 5.x ``models/deepseek_v2/modeling_deepseek_v2.py``,
``models/deepseek_v3/modeling_deepseek_v3.py``): multi-head latent attention (MLA), then dense
blocks up to ``first_k_dense_replace`` and MoE blocks after.

What differs from the Llama rules (``rules_hf.py``), per tensor (T = B·S tokens):

* ``DeepseekV3Attention.forward``: the query is ``q_b_proj(q_a_layernorm(q_a_proj(h)))`` (or one
  ``q_proj`` when ``q_lora_rank`` is None); the keys and values come from one joint down-projection
  ``kv_a_proj_with_mqa`` (B, S, Rkv + r), whose first Rkv columns ``kv_a_layernorm`` normalizes and
  ``kv_b_proj`` expands to A·(nope + vd). RoPE rotates only the r rope dims; the key's rope part is
  shared by every head. The rope table is (1, S, r) cos/sin in the activations' dtype (V3, both the
  interleaved and the half-rotated layout keep cos and sin) or, in V2, one complex64 (1, S, r/2)
  ``freqs_cis`` (``apply_rotary_emb``: a complex product keeps the table).
* In fp32 ``kv_a_layernorm``'s ``x.to(float32)`` is the split view itself, so its pow and mul keep
  the whole (B, S, Rkv + r) projection output, not the Rkv columns.
* ``expand_kv``: the key is a fresh (B, A, S, nope + r) tensor, the value a strided view of
  ``kv_b_proj``'s output. Query/key heads (hd = nope + r) and value heads (vd) differ, so PyTorch's
  CPU SDPA cannot take its flash kernel (``sdp_utils_cpp.cpp`` ``check_head_dim_size_cpp`` needs
  equal head dims) and runs the math kernel: q, k, v upcast to fp32 in 16-bit, the scaled q
  (B·A, S, hd), kᵀ (B·A, hd, S), the softmax (B, A, S, S) and v (B·A, S, vd) are kept. Eager keeps
  the same four in the activations' dtype, plus the fp32 softmax.
* The MoE router (``DeepseekV3TopkRouter``): ``F.linear`` of the input cast to fp32 (a copy in
  16-bit) and the weight (fp32: ``_keep_in_fp32_modules_strict``, as ``from_pretrained`` loads it),
  sigmoid (keeps its output, (T, E) fp32), the group-limited selection (``n_group``/``topk_group``:
  group top-2 sums, a group mask, ``masked_fill``) feeds only integer indices, so autograd drops it
  when forward moves on: nothing of it is kept; ``gather``
  keeps the top-k indices (T, k); ``norm_topk_prob``'s in-place division keeps the (T, 1) sum and
  the (T, k) weights; ``routed_scaling_factor`` multiplies by a Python float: nothing.
  ``DeepseekV2TopkRouter``: softmax (keeps (T, E) fp32) and top-k (keeps (T, k) indices); its
  ``group_limited_greedy`` also keeps the ``masked_fill`` mask (T, E) bool, since the masked scores
  are what top-k picks the weights from. V2 never renormalizes.
* The experts are transformers' ``grouped_mm`` experts, as in ``rules_hf_moe._routed_experts``: every
  routed tensor has T·k rows, so the total does not depend on ``--routing`` (DeepSeek has no
  capacity factor).

Checked against autograd's saved set and ``--profile traced`` in ``tests/estimate/test_rules_mla.py``.
"""

from __future__ import annotations

from contextlib import nullcontext
from functools import partial

from trainmem.errors import UnsupportedError
from trainmem.estimate.attention import fused_saves
from trainmem.estimate.ctx import Ctx, promote
from trainmem.estimate.graph import Sym
from trainmem.estimate.rules_hf_masks import _checkpoint_extras
from trainmem.estimate.rules_hf_moe import _routed_experts
from trainmem.estimate.rules_hf_parts import _embedding, _gated_mlp, _head, _layers, _loss, _policy, _rmsnorm
from trainmem.estimate.rules_prenorm import prenorm_block

__all__ = ["mla_forward"]


def mla_forward(ctx: Ctx) -> None:
    g, m = ctx.graph, ctx.model
    if ctx.impl.recompute not in ("none", "full", "every-k", "selective"):
        raise UnsupportedError(f"{m.name}: recompute={ctx.impl.recompute!r} is not modelled for {m.family} "
                               "(none, selective, full or every-k); --profile traced estimates it")
    if ctx.shard.sp or ctx.shard.cp > 1:
        raise UnsupportedError(f"{m.name}: sequence or context parallelism is not modelled for {m.family}'s MLA "
                               "(tensor parallelism splits its heads only)")
    kernel = _kernel(ctx)
    x = _embedding(ctx, "model.embed_tokens")
    with g.module("model.rotary_emb"):
        table = _ROPE_TABLES[m.family](ctx, x.dtype)
    held = _checkpoint_extras(ctx, kernel, x.dtype)

    def layer(i: int, x: Sym) -> Sym:
        if ctx.impl.checkpointed(i):
            with g.checkpoint(x, *table, *held, policy=_policy(ctx)):
                return _block(ctx, x, table, kernel, m.kind(i).mlp == "moe", held)
        return _block(ctx, x, table, kernel, m.kind(i).mlp == "moe", held)

    x = _layers(ctx, "model.layers.", x, layer)
    h = _rmsnorm(ctx, x, "model.norm")
    _loss(ctx, _head(ctx, h, "lm_head"))


def _kernel(ctx: Ctx) -> str:
    """Eager, or the SDPA kernel for q/k heads of hd and v heads of vd dims (:func:`_cuda_kernel` on CUDA)."""
    m, impl = ctx.model, ctx.impl
    if impl.attention == "eager":
        return "eager"
    if m.attn_dropout:
        raise UnsupportedError(f"{m.name}: attention dropout ({m.attn_dropout}) is not modelled for {m.family}; "
                               "--profile traced estimates it")
    if impl.device != "cpu":
        return _cuda_kernel(ctx)
    if impl.attention not in ("sdpa", "sdpa-math"):
        raise UnsupportedError(f"{m.name}: attention={impl.attention!r} on cpu is not modelled for {m.family} "
                               "(sdpa, sdpa-math or eager); --profile traced estimates it")
    if impl.attention == "sdpa" and m.head_dim == m.v_head_dim:
        raise UnsupportedError(f"{m.name}: equal q/k and v head dims ({m.head_dim}) let SDPA take its CPU flash "
                               "kernel, which the MLA rules do not model; --profile traced estimates it")
    return "math"


def _cuda_kernel(ctx: Ctx) -> str:
    """The kernel CUDA runs, from PyTorch's SDPA dispatcher (``aten/src/ATen/native/transformers/cuda/
    sdp_utils.cpp`` ``select_sdp_backend``) and transformers' FlashAttention-2 path. Read from the source,
    not checked on a GPU.

    * ``flash``: transformers ``integrations/flash_attention.py`` ``flash_attention_forward`` pads v to
      the q/k head dim and slices the output back (:func:`_core`); FlashAttention-2 takes 16-bit inputs.
    * ``sdpa``: ``check_head_dim_size_flash`` needs q, k and v head dims equal (and <= 256) and
      ``check_dtypes_flash_attention`` 16-bit inputs, so MLA (hd = nope + r = 192, vd = 128) skips flash;
      ``check_head_dim_size_mem_efficient`` takes q/k and v dims that differ, each a multiple of
      ``minimum_gemm_alignment`` (sm80+: 8 for 16-bit, 4 for fp32), and
      ``check_data_ptr_alignment_mem_efficient`` needs v's storage offset (it is a view of ``kv_b_proj``'s
      output starting at column nope) aligned likewise: memory-efficient, in fp32 too.
    * ``mem-efficient``: the same conditions.
    """
    m, impl = ctx.model, ctx.impl
    hd, vd, nope = m.head_dim, m.v_head_dim, m.qk_nope_head_dim
    compute = ctx.low or ctx.param
    if impl.attention == "flash":
        if compute == "float32":
            raise UnsupportedError(f"{m.name}: attention='flash' takes 16-bit inputs (FlashAttention-2); "
                                   "precision fp32 runs sdpa (memory-efficient) or eager")
        return "flash"
    if impl.attention not in ("sdpa", "mem-efficient"):
        raise UnsupportedError(f"{m.name}: attention={impl.attention!r} on {impl.device} is not modelled for "
                               f"{m.family} (sdpa, mem-efficient, flash or eager); --profile traced estimates it on CPU")
    if impl.attention == "sdpa" and compute != "float32" and hd == vd and hd <= 256:
        return "flash"  # check_head_dim_size_flash passes: SDPA's flash kernel
    align = 4 if compute == "float32" else 8
    if hd % align or vd % align or nope % align:
        raise UnsupportedError(f"{m.name}: head dims q/k {hd}, v {vd}, nope {nope} are not multiples of {align}, so "
                               "CUDA SDPA falls back to its math kernel, which the MLA rules do not model; "
                               "--profile traced estimates it on CPU")
    return "efficient"


def _cos_sin(ctx: Ctx, dtype: str) -> tuple[Sym, ...]:
    """DeepseekV3RotaryEmbedding: cos and sin (1, S, r) in the activations' dtype."""
    g, r = ctx.graph, ctx.model.qk_rope_head_dim
    return (g.new("cos", (1, ctx.S, r), ("1", "S", "rope"), dtype, False),
            g.new("sin", (1, ctx.S, r), ("1", "S", "rope"), dtype, False))


def _freqs_cis(ctx: Ctx, dtype: str) -> tuple[Sym, ...]:
    """DeepseekV2RotaryEmbedding: ``torch.polar`` -> one complex64 (1, S, r/2) table."""
    r = ctx.model.qk_rope_head_dim
    return (ctx.graph.new("freqs_cis", (1, ctx.S, r // 2), ("1", "S", "rope/2"), "complex64", False),)


#: family -> its rotary table (the router differs too: ``_ROUTERS``)
_ROPE_TABLES = {"deepseek_v3": _cos_sin, "deepseek_v2": _freqs_cis}


def _block(ctx: Ctx, x: Sym, table: tuple[Sym, ...], kernel: str, moe: bool, held: list[Sym]) -> Sym:
    return prenorm_block(ctx, x, partial(_rmsnorm, ctx), lambda h: _mla(ctx, h, table, kernel, held),
                         partial(_moe if moe else _gated_mlp, ctx))


def _mla(ctx: Ctx, h: Sym, table: tuple[Sym, ...], kernel: str, held: list[Sym]) -> Sym:
    g, m = ctx.graph, ctx.model
    B, S, H, A = ctx.B, ctx.S, m.hidden_size, m.num_heads
    hd, vd, nope, r, R = m.head_dim, m.v_head_dim, m.qk_nope_head_dim, m.qk_rope_head_dim, m.kv_lora_rank
    if m.q_lora_rank:
        with g.module("q_a_proj"):
            qa = ctx.linear(h, m.q_lora_rank, "Rq", weight=(m.q_lora_rank, H), bias=m.qkv_bias)
        qa = _rmsnorm(ctx, qa, "q_a_layernorm")
        with g.module("q_b_proj"):
            q = ctx.linear(qa, A * hd, "A·hd", weight=(A * hd, m.q_lora_rank))
    else:
        with g.module("q_proj"):
            q = ctx.linear(h, A * hd, "A·hd", weight=(A * hd, H))
    with g.module("kv_a_proj_with_mqa"):
        c = ctx.linear(h, R + r, "Rkv+rope", weight=(R + r, H), bias=m.qkv_bias)
    latent = _latent_norm(ctx, c)
    # the rope dims rotate against the table (the product keeps the table: q and k need grad, it does not)
    g.save(*table, when=q.requires_grad or c.requires_grad)
    heads, dims = (B, A, S, hd), ("B", "A", "S", "hd")
    query = g.new("query_states", heads, dims, q.dtype, q.requires_grad)  # torch.cat((q_pass, q_rot))
    with g.module("kv_b_proj"):
        kv = ctx.linear(latent, A * (nope + vd), "A·(nope+vd)", weight=(A * (nope + vd), R))
    key = g.new("key_states", heads, dims, kv.dtype, kv.requires_grad)  # expand_kv: new_empty + copy_
    # selective (trace/recompute.py selective_recompute): the attention function is checkpointed; it holds
    # q, k, v (a view of kv_b_proj's output: all of it) and what rides along (position ids, eager's mask)
    with g.checkpoint(query, key, kv, *held) if ctx.impl.recompute == "selective" else nullcontext():
        o = _core(ctx, query, key, kv, kernel)
    with g.module("o_proj"):
        return ctx.linear(o, H, "H", weight=(H, A * vd), bias=m.out_bias)


def _latent_norm(ctx: Ctx, c: Sym) -> Sym:
    """``kv_a_layernorm`` over the first Rkv columns of ``c`` (a DeepseekV3RMSNorm, as ``_rmsnorm``),
    except that in fp32 ``x.to(float32)`` is the view itself: pow and mul keep all of ``c``."""
    g, R = ctx.graph, ctx.model.kv_lora_rank
    shape, dims = c.shape[:-1] + (R,), c.dims[:-1] + ("Rkv",)
    if c.dtype != "float32":  # the view is cast to a new fp32 tensor: as any RMSNorm
        return _rmsnorm(ctx, Sym(f"{c.name}[:Rkv]", shape, dims, c.dtype, c.requires_grad), "kv_a_layernorm")
    with g.module("kv_a_layernorm"):
        wt, rg = ctx.weight_trainable(), c.requires_grad
        g.save(c, g.new("rsqrt", shape[:-1] + (1,), dims[:-1] + ("1",), "float32", rg), when=rg)
        g.save(g.new("normed", shape, dims, "float32", rg), when=wt)
        return g.new("out", shape, dims, promote(ctx.param, "float32"), rg or wt)


def _core(ctx: Ctx, q: Sym, k: Sym, kv: Sym, kernel: str) -> Sym:
    """Attention with hd-wide q/k heads and vd-wide v heads (``eager_attention_forward`` or SDPA's
    math kernel, ``aten/src/ATen/native/transformers/attention.cpp``
    ``_scaled_dot_product_attention_math``); returns the (B, S, A·vd) input of ``o_proj``."""
    g, m = ctx.graph, ctx.model
    B, S, A, hd, vd = ctx.B, ctx.S, m.num_heads, m.head_dim, m.v_head_dim
    rg = q.requires_grad or k.requires_grad
    low = ctx.low
    if kernel in ("flash", "efficient"):
        return _fused_core(ctx, q, k, kv, kernel)
    heads, hdims = (B, A, S, hd), ("B", "A", "S", "hd")
    vheads, vdims = (B, A, S, vd), ("B", "A", "S", "vd")
    scores, sdims = (B, A, S, S), ("B", "A", "S", "S")
    if kernel == "math":
        # q, k, v reach the kernel in the autocast dtype; 16-bit ones are upcast to fp32 (CPU math)
        dt = "float32"
        qs = g.new("q_scaled", heads, hdims, dt, rg)  # q * sqrt(scale) (a new tensor even in fp32)
        kt = g.new("k_t_scaled", heads, hdims, dt, rg)  # (k * sqrt(scale))ᵀ, reshaped for bmm
        g.save(qs, kt, when=rg)
        sm = g.new("softmax", scores, sdims, dt, rg)
        g.save(sm, when=rg)
        v = g.new("v_bmm", vheads, vdims, dt, kv.requires_grad)  # the strided value, copied for bmm
        g.save(v, when=rg)
        return g.new("attn_out", (B, S, A * vd), ("B", "S", "A·vd"), low or q.dtype, rg)
    if low:
        q, k = ctx.cast(q, low, "q_cast"), ctx.cast(k, low, "k_cast")
    kt = g.new("k_t", heads, hdims, k.dtype, rg)  # key.transpose(2, 3), reshaped (copied) for bmm
    g.save(q, kt, when=rg)
    sm = g.new("softmax", scores, sdims, "float32", rg)  # softmax(dtype=float32)
    g.save(sm, when=rg)
    probs = ctx.cast(sm, q.dtype, "probs")  # .to(query.dtype)
    if low:
        probs = ctx.cast(probs, low, "probs_cast")
    v = g.new("v_bmm", vheads, vdims, low or kv.dtype, kv.requires_grad)
    g.save(probs, v, when=rg)
    return g.new("attn_out", (B, S, A * vd), ("B", "S", "A·vd"), probs.dtype, rg)


def _fused_core(ctx: Ctx, q: Sym, k: Sym, kv: Sym, kernel: str) -> Sym:
    """A fused CUDA kernel (:func:`_cuda_kernel`), keeping what ``attention.fused_saves`` lists.

    SDPA (``efficient``, or ``flash`` when hd == vd): the autograd node keeps q, k and v as passed, and v
    is the strided split of ``kv_b_proj``'s output, so all of that output (B, S, A·(nope+vd)) stays
    (a 16-bit cast under autocast would be a (B, A, S, vd) copy instead); the (B, A, S, vd) output is
    already (B, S, A·vd) in memory, which ``o_proj`` keeps too (no copy in ``sdpa_attention_forward``).
    FlashAttention-2 through transformers with vd < hd: ``F.pad`` makes a fresh (B, S, A, hd) v, the
    kernel's output is hd wide, and ``[..., :vd]`` then ``reshape`` copies the (B, S, A·vd) ``o_proj`` input.
    """
    g, m = ctx.graph, ctx.model
    B, S, A, hd, vd = ctx.B, ctx.S, m.num_heads, m.head_dim, m.v_head_dim
    low = ctx.low
    if low:  # SDPA is on autocast's lower-precision list; 16-bit inputs pass unchanged
        q, k = ctx.cast(q, low, "q_cast"), ctx.cast(k, low, "k_cast")
    v = kv if not low or kv.dtype == low else g.new("v_cast", (B, A, S, vd), ("B", "A", "S", "vd"), low, kv.requires_grad)
    out_vd = (B, S, A * vd), ("B", "S", "A·vd")
    if ctx.impl.attention != "flash" or hd == vd:
        return fused_saves(ctx, q, k, v, kernel, *out_vd)
    v = g.new("v_padded", (B, A, S, hd), ("B", "A", "S", "hd"), v.dtype, v.requires_grad)  # F.pad(value, [0, hd-vd])
    out = fused_saves(ctx, q, k, v, kernel, (B, S, A * hd), ("B", "S", "A·hd"))
    return g.new("attn_out", *out_vd, out.dtype, out.requires_grad)  # attn_output[..., :vd].reshape: a copy


def _moe(ctx: Ctx, h: Sym) -> Sym:
    with ctx.graph.module("gate"):
        w_dtype = _ROUTERS[ctx.model.family](ctx, h)
    return _routed_experts(ctx, h, w_dtype)


def _router_logits(ctx: Ctx, h: Sym) -> Sym:
    """``F.linear(h.type(float32), weight.type(float32))``: an fp32 copy of a 16-bit input (kept for
    the weight's gradient). The weight is fp32 already: ``_keep_in_fp32_modules_strict`` names
    ``gate.weight``, which ``from_pretrained(dtype=...)`` keeps fp32 (``models/hf.py`` builds it so)."""
    E, H = ctx.model.num_experts, ctx.model.hidden_size
    return ctx.linear(ctx.cast(h, "float32", "input_fp32"), E, "E", weight=(E, H))


def _sigmoid_router(ctx: Ctx, h: Sym) -> str:
    """DeepseekV3TopkRouter (see the module docstring); returns the top-k weights' dtype."""
    g, m = ctx.graph, ctx.model
    T, E, k = ctx.B * ctx.S, m.num_experts, m.top_k
    logits = _router_logits(ctx, h)
    scores = g.new("scores", (T, E), ("B·S", "E"), logits.dtype)
    g.save(scores, g.new("top_idx", (T, k), ("B·S", "k"), "int64", False))
    g.save(g.new("top_sum", (T, 1), ("B·S", "1"), logits.dtype),
           g.new("top_val", (T, k), ("B·S", "k"), logits.dtype), when=m.router_norm_topk)
    return logits.dtype


def _softmax_router(ctx: Ctx, h: Sym) -> str:
    """DeepseekV2TopkRouter (see the module docstring); returns the top-k weights' dtype."""
    g, m = ctx.graph, ctx.model
    T, E, k = ctx.B * ctx.S, m.num_experts, m.top_k
    _router_logits(ctx, h)
    g.save(g.new("probs", (T, E), ("B·S", "E"), "float32"), g.new("top_idx", (T, k), ("B·S", "k"), "int64", False))
    g.save(g.new("group_mask", (T, E), ("B·S", "E"), "bool", False), when=m.router_group_mask)
    return "float32"  # softmax(dtype=torch.float32)


#: family -> its router, which keeps its own tensors and returns the top-k weights' dtype
_ROUTERS = {"deepseek_v3": _sigmoid_router, "deepseek_v2": _softmax_router}
