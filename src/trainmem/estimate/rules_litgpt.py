"""``--framework litgpt``: what LitGPT's own decoder block keeps for backward (hf profile, Llama-style).

LitGPT does not run transformers' modules: ``litgpt/model.py`` has its own ``Block``,
``CausalSelfAttention`` (one fused ``qkv`` linear) and ``RMSNorm``, and ``litgpt/lora.py`` its own
``LoRAQKVLinear`` (one adapter over the fused projection). Read from litgpt 0.5.13 and checked to the
byte against it on CPU (``tests/estimate/test_rules_litgpt.py``); the config-hub commit e5493986
(July 2024) saves the same storages for these blocks (checked by hand on CPU, see docs/litgpt.md).
Names stay transformers' module paths (``model.layers.{i}.self_attn...``), so the parameters,
LoRA targets and the rest of the estimate are unchanged; LitGPT's own pieces get their own labels.

Per block, against the ``hf`` rules:

* ``RMSNorm.forward`` computes in fp32 and multiplies by ``self.weight.float()``: a new (H,) fp32
  tensor that mul keeps, and, when the weight trains, the fp32 normalized tensor (HF keeps it cast).
* ``CausalSelfAttention.forward``: RoPE ends in ``torch.cat`` (fresh (B, A, S, hd) q and
  (B, Akv, S, hd) k); grouped K and V are ``repeat_interleave``-d to A heads before SDPA (no
  ``enable_gqa``); with A = Akv, V reaches SDPA as a view of the fused ``qkv`` output, so the whole
  (B, S, (A+2·Akv)·hd) storage is kept. SDPA's (B, A, S, hd) output is transposed and reshaped
  into a fresh (B, S, A·hd) copy, the ``proj`` input.
* ``LoRAQKVLinear.forward``: one dropout for all of q, k, v; ``lora_A`` (N·r, H) for the N enabled
  projections; ``conv1d`` keeps ``after_A``; ``zero_pad``'s ``index_copy_`` keeps ``after_B``
  (B, S, Σ enabled widths) and the index (Σ int64, cloned per call) unless all three are enabled. ``LoRALinear`` (proj, MLP) keeps what
  peft's ``Linear`` keeps, so those use the shared rule.

Known limitations: Llama-style blocks only (RMSNorm without unit offset, SiLU-gated ``LLaMAMLP``,
separate q/k/v in the HF family, no q/k norm, no MoE); SDPA's fused kernels (LitGPT has no eager
path without soft-capping); no autocast, tensor/context parallelism or selective recompute;
LitGPT's cos/sin are registered buffers (max_seq_length rows), counted here as the hf profile's
(1, S, hd) tables. ``--framework lit-gpt`` is the October 2023 ``lit_gpt`` package (8641822, before
6178c7cc "Half precision fixes"): the same attention and LoRA, an RMSNorm in the input's dtype. The
April 2024 norm (43c44323: cast to the input dtype before the weight) is not told apart: it keeps
(H,) fp32 less, and a 16-bit instead of an fp32 normalized tensor when the weight trains.
"""

from __future__ import annotations

from functools import partial

from trainmem.errors import SpecError, UnsupportedError
from trainmem.estimate.attention import fused_saves
from trainmem.estimate.ctx import Ctx
from trainmem.estimate.finetune import lora_targeted
from trainmem.estimate.graph import Sym
from trainmem.estimate.rules_hf_parts import _gated_mlp, _rules
from trainmem.estimate.rules_prenorm import prenorm_block

__all__ = ["check_run", "litgpt_block", "litgpt_rmsnorm"]


def litgpt_rmsnorm(ctx: Ctx, x: Sym, name: str) -> Sym:
    """litgpt/model.py ``RMSNorm.forward``: ``(x.float() * rsqrt(mean(x²)+eps) * weight.float()).to(dtype)``.
    Keeps the fp32 input and rsqrt (x needs grad), ``weight.float()`` (a new tensor unless fp32) for
    x's gradient and the fp32 normalized tensor for the weight's."""
    g = ctx.graph
    with g.module(name):
        wt = ctx.weight_trainable()
        if ctx.impl.framework == "lit-gpt":  # lit_gpt/rmsnorm.py before 6178c7cc (Oct 2023): all in x's dtype,
            # `self.weight * (x * rsqrt(mean(x*x) + eps))`: keeps x itself and rsqrt, normed for the weight
            rs = g.new("rsqrt", x.shape[:-1] + (1,), x.dims[:-1] + ("1",), x.dtype, x.requires_grad)
            g.save(x, rs, when=x.requires_grad)
            g.save(g.new("normed", x.shape, x.dims, x.dtype, x.requires_grad), when=wt)
            return g.new("out", x.shape, x.dims, x.dtype, x.requires_grad or wt)
        x32 = ctx.cast(x, "float32", "x_fp32")
        rs = g.new("rsqrt", x.shape[:-1] + (1,), x.dims[:-1] + ("1",), "float32", x.requires_grad)
        g.save(x32, rs, when=x.requires_grad)
        normed = g.new("normed", x.shape, x.dims, "float32", x.requires_grad)
        # `(1 + self.weight) if self.add_unit_offset else self.weight` then `.float()`: a new (H,) fp32 tensor
        # unless the weight is already fp32 and used as is (Gemma's unit offset: config.norm_class)
        if ctx.param != "float32" or _rules(ctx).unit_offset_norm:
            g.save(g.new("weight_fp32", x.shape[-1:], x.dims[-1:], "float32", wt), when=x.requires_grad)
        g.save(normed, when=wt)
        return ctx.cast(g.new("out_fp32", x.shape, x.dims, "float32", x.requires_grad or wt), x.dtype, "out")


def _check(ctx: Ctx, kernel: str, masked: bool, moe: bool) -> None:
    m, rules = ctx.model, _rules(ctx)
    plain = not (rules.fused_qkv or rules.fused_gate_up or rules.unit_offset_norm or rules.post_norms
                 or rules.sandwich_norms or m.qk_norm or moe or not m.gated or m.attn_softcap)
    if not plain:
        raise UnsupportedError(f"{m.name}: --framework litgpt models LitGPT's LLaMA blocks (RMSNorm, LLaMAMLP, "
                               f"fused qkv); {m.family} blocks are not modelled")
    check_run(ctx, kernel, masked)


def check_run(ctx: Ctx, kernel: str, masked: bool) -> None:
    """What every LitGPT block rule needs: SDPA without a mask, no autocast, recompute or TP/CP."""
    impl = ctx.impl
    if kernel not in ("flash", "efficient") or masked:
        raise UnsupportedError(f"--framework litgpt: LitGPT calls SDPA without a mask (flash or mem-efficient), "
                               f"not {kernel}{' with a window mask' if masked else ''}")
    if ctx.low or impl.recompute in ("selective", "op") or ctx.shard.tp > 1 or ctx.shard.cp > 1:
        raise UnsupportedError("--framework litgpt is modelled without autocast, selective/op recompute, "
                               "tensor or context parallelism")


def _lora_qkv(ctx: Ctx, h: Sym, base: Sym) -> Sym:
    """litgpt/lora.py ``LoRAQKVLinear.forward`` on top of the frozen fused projection ``base``."""
    g, m = ctx.graph, ctx.model
    spec = getattr(ctx.finetune_linear, "spec", None)
    widths = (("q_proj", m.q_size), ("k_proj", m.kv_size), ("v_proj", m.kv_size))
    on = [w for n, w in widths if spec is not None and lora_targeted(g.path(n), spec)]
    if not on:
        return base
    if "all-linear" in spec.lora_targets:  # LitGPT's lora_query/key/value/projection/mlp/head flags
        raise SpecError("lora_targets", ",".join(spec.lora_targets), "--framework litgpt needs named targets "
                        "(q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj,lm_head), not all-linear")
    dtype = getattr(ctx.finetune_linear, "adapter_dtype", h.dtype)
    if dtype != h.dtype:  # F.linear(x, lora_A) needs one dtype: LitGPT's adapters are in the model's
        raise SpecError("adapter_dtype", dtype, f"LitGPT's adapters are in the model's dtype ({h.dtype}): "
                                                "use --adapter-dtype param")
    r, n = spec.lora_rank, len(on)
    with g.module("qkv_proj"):
        d = ctx.dropout(h, spec.lora_dropout, "lora_dropout")
        g.save(d)  # F.linear(dropout(x), lora_A) keeps its input for lora_A's gradient
        after_a = g.new("lora_A_out", h.shape[:-1] + (n * r,), h.dims[:-1] + (f"{n}·r",), h.dtype, True)
        g.save(after_a)  # conv1d (or its chunks) keeps the input for lora_B's gradient
        total = sum(on)
        after_b = g.new("lora_B_out", h.shape[:-1] + (total,), h.dims[:-1] + ("Σ lora widths",), h.dtype, True)
        if n < 3:  # zero_pad: new_zeros(...).index_copy_(-1, self.lora_ind, after_B) keeps its source and
            # the index, which litgpt 0.5.x's lora_ind property clones from its buffer on every call
            g.save(after_b, g.new("lora_ind", (total,), ("Σ lora widths",), "int64", False))
            after_b = g.new("lora_padded", base.shape, base.dims, h.dtype, True)
        return ctx.add(base, after_b, "lora_sum")  # `* self.scaling` (a float) keeps nothing


def _attention(ctx: Ctx, h: Sym, cos: Sym, sin: Sym, kernel: str, *, out_name: str = "o_proj",
               core=None) -> Sym:
    """``CausalSelfAttention.forward``; ``out_name``: the HF name of ``proj`` (GPT-NeoX's ``dense``);
    ``core(ctx, q, k, v)``: an attention core other than SDPA (``rules_litgpt_variants``'s soft-capped one)."""
    g, m = ctx.graph, ctx.model
    B, S, A, Akv, hd = ctx.B, ctx.S, m.num_heads, m.num_kv_heads, m.head_dim
    width = m.q_size + 2 * m.kv_size
    with g.module("qkv_proj"):
        qkv = ctx.linear(h, width, "(A+2·Akv)·hd", weight=(width, m.hidden_size), bias=m.qkv_bias)
    qkv = _lora_qkv(ctx, h, qkv)
    rg = qkv.requires_grad
    heads, kv_heads = ("B", "A", "S", "hd"), ("B", "Akv", "S", "hd")
    g.save(cos, sin, when=rg)  # apply_rope: x * cos + rotated * sin
    q = g.new("q_roped", (B, A, S, hd), heads, qkv.dtype, rg)  # torch.cat((q_roped, q[..., n:]), -1)
    k = g.new("k_roped", (B, Akv, S, hd), kv_heads, qkv.dtype, rg)
    if Akv != A:  # repeat_interleave(q_per_kv, dim=1): fresh A-head copies of K and V
        k = g.new("k_repeat", (B, A, S, hd), heads, k.dtype, rg)
        v = g.new("v_repeat", (B, A, S, hd), heads, k.dtype, rg)
    else:  # V is a split/view/transpose of the fused output: SDPA keeps the whole qkv storage
        v = qkv
    out = core(ctx, q, k, v) if core else fused_saves(ctx, q, k, v, kernel, (B, A, S, hd), heads)
    # y.transpose(1, 2).reshape(B, T, A·hd): a copy, the proj input
    y = g.new("attn_out", (B, S, A * hd), ("B", "S", "A·hd"), out.dtype, rg)
    with g.module(out_name):
        return ctx.linear(y, m.hidden_size, "H", weight=(m.hidden_size, m.q_size), bias=m.out_bias)


def litgpt_block(ctx: Ctx, x: Sym, cos: Sym, sin: Sym, kernel: str, held: list[Sym] = (), *,
                 masked: bool = False, moe: bool = False) -> Sym:
    """litgpt/model.py ``Block.forward`` (non-parallel residual): norm_1, attn, residual, norm_2,
    ``LLaMAMLP`` (the same saved set as transformers' gated MLP), residual."""
    _check(ctx, kernel, masked, moe)
    return prenorm_block(ctx, x, partial(litgpt_rmsnorm, ctx), lambda h: _attention(ctx, h, cos, sin, kernel),
                         partial(_gated_mlp, ctx))
