"""Attention cores: what each kernel keeps for backward.

Inputs are the per-head tensors as they reach the kernel (after RoPE), in
(B, heads, S, head_dim) order; the returned tensor is the attention output in
(B, S, A·hd) layout, which is what the output projection receives.
"""

from __future__ import annotations

from trainmem.errors import UnsupportedError
from trainmem.estimate.context_parallel import ring_merged_copy
from trainmem.estimate.ctx import Ctx, promote
from trainmem.estimate.graph import Sym
from trainmem.specs import ImplSpec, ModelSpec, StepSpec
from trainmem.specs.layer_kind import LayerKind

__all__ = ["KERNELS", "kernel_for", "resolve_kernel", "attention_core", "fused_saves", "window_mask"]

#: what :func:`kernel_for` answers: transformers' eager attention, or the SDPA backend that runs
KERNELS = ("eager", "math", "efficient", "flash")


def window_mask(ctx: Ctx, kind: LayerKind) -> bool:
    """Whether transformers hands SDPA an explicit (B, 1, S, S) mask for a block of this kind.

    A sliding or chunked layer gets one once the keys reach the window
    (``masking_utils._ignore_causal_mask_sdpa``: no skip when ``kv_length >= local_attention_size``);
    a full layer relies on ``is_causal``. FlashAttention-2 (``--attention flash`` on CUDA) takes the
    window as ``window_size`` and no mask (``modeling_flash_attention_utils``)."""
    if kind.attention not in ("sliding", "chunked") or ctx.S < kind.window:
        return False
    return ctx.impl.attention != "flash" or ctx.impl.device == "cpu"


def resolve_kernel(ctx: Ctx, masked: bool = False) -> str:
    """Which kernel ``impl.attention`` runs on ``impl.device`` for this block rule's model and precision
    (:func:`kernel_for`)."""
    return kernel_for(ctx.model, ctx.step, ctx.impl, masked)


def kernel_for(model: ModelSpec, step: StepSpec, impl: ImplSpec, masked: bool = False) -> str:
    """Which kernel ``impl.attention`` runs on ``impl.device`` for ``model`` at ``step``'s precision: one of
    :data:`KERNELS`.

    Follows PyTorch's SDPA dispatcher: on CUDA, flash for 16-bit inputs and memory-efficient
    for fp32; on CPU, the CPU flash kernel, except with dropout, where only math supports it.
    ``masked``: an explicit mask (:func:`window_mask`); CUDA's flash kernel takes none
    (``sdp_utils.cpp`` ``check_for_attn_mask``), so SDPA picks memory-efficient there.
    V heads narrower than q/k's (MLA's ``v_head_dim``): both flash kernels need equal head dims
    (``sdp_utils_cpp.cpp`` ``check_head_dim_size_cpp``, ``sdp_utils.cpp`` ``check_head_dim_size_flash``), so
    CPU runs math and CUDA memory-efficient (estimate/rules_mla.py ``_kernel``, which also refuses what it does
    not model).
    """
    kind = impl.attention
    if kind == "eager":
        return "eager"
    if kind == "sdpa-math":
        return "math"
    if kind == "mem-efficient":
        return "efficient"
    if kind == "flash":
        return "flash"
    # sdpa: PyTorch picks
    uneven = bool(model.v_head_dim) and model.v_head_dim != model.head_dim
    if impl.device == "cpu":
        return "math" if model.attn_dropout > 0 or uneven else "flash"
    d = step.dtypes
    compute = d.activation if d.autocast else d.compute  # autocast's dtype, else the weights' (Ctx.low or Ctx.param)
    if compute == "float32" or model.head_dim > 256 or masked or uneven:
        return "efficient"
    return "flash"


def attention_core(ctx: Ctx, q: Sym, k: Sym, v: Sym, *, kernel: str, gqa_native: bool,
                   softmax_fp32: bool = True, softcap: float = 0.0, out_copy: bool = False,
                   q_copy: bool = False, masked: bool = False, fused: Sym | None = None,
                   kept: tuple[Sym, ...] = ()) -> Sym:
    """Run one attention core inside the current module scope.

    ``gqa_native``: K/V reach the kernel with ``num_kv_heads`` heads (SDPA ``enable_gqa`` or
    fused QKV layouts); otherwise they are repeated to ``num_heads`` first (HF ``repeat_kv``).
    ``softmax_fp32``: the eager softmax is asked for fp32 output (Llama family) rather than
    running in the scores' dtype (GPT-2; CUDA autocast still promotes it to fp32).
    ``out_copy``: the fused kernels' output comes back in (B, A, S, hd) layout because q was
    made contiguous (RoPE by ``torch.cat``), so ``transpose(1, 2).contiguous()`` copies it.
    ``q_copy``: ``q`` is a strided view (GPT-2's split of the fused QKV output); bmm reshapes it
    into a heads-wide copy, which is what eager attention keeps.
    ``fused``: the fused QKV output of which ``q`` (and ``k``, ``v`` where they are ``fused`` itself: no KV
    cache) are strided (B, A, S, hd) views. ``matmul`` reshapes each to (B·A, S, hd) for bmm: with B == 1
    the size-1 batch dim merges with any stride and the reshape is a view, so bmm keeps the whole fused
    output's storage; with B > 1 it copies (``aten/src/ATen/native/LinearAlgebra.cpp`` ``_matmul_impl``,
    ``TensorShape.cpp`` ``reshape`` -> ``computeStride``). The math kernel pre-scales q and k (fresh
    tensors), so there only V can stay a view.
    ``kept``: K/V tensors whose (B·A, ...) reshape for bmm is a view in eager attention, so bmm keeps them
    as they are (GPT-BigCode's contiguous KV-cache copies: all A heads, or one head at B == 1, whose
    ``repeat_kv`` expand has stride 0 over the heads; ``estimate/rules_gpt_bigcode.py``).
    ``masked``: SDPA gets an explicit mask (:func:`window_mask`). transformers then repeats K/V
    (``sdpa_attention.use_gqa_in_sdpa`` is False with a mask), and SDPA turns the boolean mask into
    an additive one in the query's dtype on every call (``attention.cpp``
    ``convert_boolean_attn_mask``), which the fused kernels keep for backward: (B, 1, S, S) per layer.
    """
    if masked:
        gqa_native = False
    g, m = ctx.graph, ctx.model
    B, S, A, hd = ctx.B, ctx.S, m.num_heads, m.head_dim
    rg = q.requires_grad or k.requires_grad or v.requires_grad
    heads_shape, heads_dims = (B, A, S, hd), ("B", "A", "S", "hd")
    scores_shape, scores_dims = (B, A, S, S), ("B", "A", "S", "S")
    out_shape, out_dims = (B, S, A * hd), ("B", "S", "A·hd")
    low = ctx.low
    if kernel in ("flash", "efficient"):
        if low:  # SDPA is on autocast's lower-precision list
            q, k, v = (ctx.cast(t, low, f"{n}_cast") for t, n in ((q, "q"), (k, "k"), (v, "v")))
        # transformers' repeat_kv (modeling_llama.py / modeling_mistral.py) returns its input when
        # n_rep == 1, and with ONE KV head expand(B, 1, n_rep, S, hd).reshape(B, n_rep, S, hd) is a
        # view (the size-1 head dim merges): no copy either way, SDPA keeps k and v themselves
        if not gqa_native and m.num_kv_heads not in (1, A):
            k = g.new("k_repeat", heads_shape, heads_dims, k.dtype, k.requires_grad)
            v = g.new("v_repeat", heads_shape, heads_dims, v.dtype, v.requires_grad)
        cp = ctx.shard.cp
        if cp > 1 and ctx.shard.cp_style == "allgather":  # K and V gathered over the context group
            k, v = (_gathered(g, t, f"{n}_gathered", cp) for t, n in ((k, "k"), (v, "v")))
        out = fused_saves(ctx, q, k, v, kernel, out_shape, out_dims, masked=masked)
        if out_copy or ring_merged_copy(ctx):
            return g.new("attn_out", out.shape, out.dims, out.dtype, rg)
        return out
    # eager / math: materialized scores
    if ctx.shard.cp > 1:
        raise UnsupportedError(f"context parallelism needs a fused attention kernel (flash or mem-efficient), not {kernel}")
    out_dtype = low or v.dtype
    if kernel == "math" and ctx.impl.device == "cpu" and (low or q.dtype) != "float32":
        # the CPU math kernel upcasts 16-bit q, k, v to fp32 and computes in fp32
        q, k, v = (g.new(f"{n}_fp32", t.shape, t.dims, "float32", t.requires_grad) for t, n in ((q, "q"), (k, "k"), (v, "v")))
        low = None
    def view_kept(t: Sym) -> bool:  # a strided view of ``fused`` that bmm keeps as is (B == 1)
        return (fused is not None and t is fused and B == 1) or any(t is k for k in kept)

    if q_copy and not (kernel == "eager" and view_kept(q)):
        q = g.new("q", heads_shape, heads_dims, q.dtype, q.requires_grad)
    qm = ctx.cast(q, low, "q_cast") if low else q
    k_in = ctx.cast(k, low, "k_cast") if low else k
    # the K operand reaches bmm as a fresh (B·A, hd, S) copy: repeat_kv, or the transpose's reshape
    kt = k_in if kernel == "eager" and view_kept(k_in) else \
        g.new("k_t", heads_shape, heads_dims, k_in.dtype, k_in.requires_grad)
    g.save(qm, when=kt.requires_grad)  # bmm keeps each operand for the other's gradient
    g.save(kt, when=qm.requires_grad)
    # Q·Kᵀ's bmm output; the scaling (or the math kernel's pre-scaled q) makes the next tensor
    g.new("scores", scores_shape, scores_dims, qm.dtype, qm.requires_grad or kt.requires_grad, op="bmm")
    # eager adds the causal mask (in the embedding dtype) before softmax: type promotion applies
    if softcap:  # Gemma-2: cap * tanh(scores / cap) before the mask; tanh keeps its output
        g.save(g.new("softcap_tanh", scores_shape, scores_dims, qm.dtype, True), when=qm.requires_grad or kt.requires_grad)
    masked = kernel == "eager" and m.arch == "decoder"  # encoders without padding pass no mask
    scores_dtype = promote(qm.dtype, ctx.param) if masked else qm.dtype
    sm_dtype = "float32" if softmax_fp32 or (low and ctx.impl.device == "cuda") else scores_dtype
    probs32 = g.new("softmax", scores_shape, scores_dims, sm_dtype, qm.requires_grad or kt.requires_grad)
    g.save(probs32, when=probs32.requires_grad)
    probs = ctx.cast(probs32, q.dtype if softmax_fp32 else v.dtype, "probs")
    probs = ctx.dropout(probs, m.attn_dropout, "attn_dropout")
    if low:
        probs = ctx.cast(probs, low, "probs_cast")
        v = ctx.cast(v, low, "v_cast")
    # V likewise reaches bmm as a fresh heads-wide copy (repeat_kv, the KV-cache cat, or a reshape)
    vv = v if view_kept(v) else g.new("v_repeat", heads_shape, heads_dims, v.dtype, v.requires_grad)
    g.save(probs, when=vv.requires_grad)
    g.save(vv, when=probs.requires_grad)
    # P·V's bmm output (B, A, S, hd); transpose(1, 2).contiguous() copies it into attn_out
    g.new("pv", heads_shape, heads_dims, vv.dtype, probs.requires_grad or vv.requires_grad, op="bmm")
    out_dtype = out_dtype if kernel == "math" else probs.dtype
    return g.new("attn_out", out_shape, out_dims, out_dtype, rg)


def fused_saves(ctx: Ctx, q: Sym, k: Sym, v: Sym, kernel: str, out_shape: tuple[int, ...],
                out_dims: tuple[str, ...], *, masked: bool = False) -> Sym:
    """What a fused SDPA kernel (``flash`` or ``efficient``) keeps for backward, given q, k, v as they
    reach it: the three inputs, its output (``out_shape``, in q's dtype), the fp32 log-sum-exp
    (B, A, S), which the memory-efficient kernel pads to a multiple of 32 queries, the additive mask
    when ``masked`` and the RNG state with dropout on CUDA. Returns the output. Shared by
    :func:`attention_core` and the MLA rules (``rules_mla.py``), whose v heads are narrower."""
    g, m = ctx.graph, ctx.model
    B, S, A = ctx.B, ctx.S, m.num_heads
    rg = q.requires_grad or k.requires_grad or v.requires_grad
    # the aten op, for an op-level checkpoint policy: _scaled_dot_product_{flash,efficient}_attention
    # on CUDA, _scaled_dot_product_flash_attention_for_cpu on CPU
    op = f"sdpa_{kernel}" + ("_cpu" if ctx.impl.device == "cpu" else "")
    out = g.new("sdpa_out", out_shape, out_dims, q.dtype, rg, op=op)
    if kernel == "flash":
        lse = g.new("lse", (B, A, S), ("B", "A", "S"), "float32", op=op)
    else:  # memory-efficient pads the log-sum-exp to a multiple of 32 queries
        s32 = -(-S // 32) * 32
        lse = g.new("lse", (B, A, s32), ("B", "A", "⌈S/32⌉·32"), "float32", op=op)
    g.save(q, k, v, out, lse, when=rg)
    if masked:
        g.save(g.new("attn_mask", (B, 1, S, S), ("B", "1", "S", "S"), q.dtype, False, op=op), when=rg)
    if m.attn_dropout > 0 and ctx.impl.device == "cuda":
        g.save(g.new("rng_state", (2,), ("2",), "int64", False, op=op), when=rg)
    return out


def _gathered(g, t: Sym, label: str, cp: int) -> Sym:
    """``t`` all-gathered over the context group: its sequence axis (the one before the last in
    the (B, A, S, hd) layout, the second in (B, S, heads·hd)) grows ``cp`` times."""
    ax = 2 if len(t.shape) == 4 else 1
    shape = t.shape[:ax] + (t.shape[ax] * cp,) + t.shape[ax + 1:]
    return g.new(label, shape, t.dims[:ax] + (f"{t.dims[ax]}·cp",) + t.dims[ax + 1:], t.dtype, t.requires_grad)
