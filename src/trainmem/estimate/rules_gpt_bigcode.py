"""GPT-BigCode's block (``transformers/models/gpt_bigcode/modeling_gpt_bigcode.py``, 5.24): GPT-2's
model forward (``rules_hf._gpt``: wte + wpe, dropout, blocks, ``ln_f``, head, loss) around a block
whose attention differs.

``GPTBigCodeAttention.forward``: one packed ``c_attn`` (``nn.Linear``, width ``A·hd + 2·Akv·hd``).
With ``multi_query`` it splits ``c_attn(x).unsqueeze(1)`` into q (viewed to (B, A, S, hd)) and a
one-head k and v (B, 1, S, hd); without, ``view(B, S, A, 3·hd).transpose(1, 2).split(hd)``. All
three are strided views of the ``c_attn`` output. A training forward still builds a ``DynamicCache``
(``GPTBigCodeModel.forward``: ``use_cache`` defaults to the config's True), whose
``DynamicLayer.update`` hands attention fresh ``torch.cat`` copies of k and v (Akv heads); a
checkpointed block runs without it (``GradientCheckpointingLayer.__call__``).
Attention (``ALL_ATTENTION_FUNCTIONS``): SDPA gets the one K/V head with ``enable_gqa``
(``integrations/sdpa_attention.py`` ``use_gqa_in_sdpa``: no mask, hd <= 256); eager repeats it
(``repeat_kv``: an expand, a view for one head) and softmaxes in fp32 (``eager_attention_forward``);
FlashAttention-2 takes the one head as it is. The MLP is GPT-2's with ``ACT2FN[activation_function]``
(``gelu_pytorch_tanh``: one ``F.gelu`` that keeps its input).
"""

from __future__ import annotations

from contextlib import nullcontext

from trainmem.errors import UnsupportedError
from trainmem.estimate.attention import attention_core, resolve_kernel
from trainmem.estimate.ctx import Ctx
from trainmem.estimate.graph import Sym
from trainmem.estimate.rules_hf_parts import _layernorm, _two_matrix_mlp

__all__ = ["gpt_bigcode_forward"]


#: checkpointed blocks (``--recompute full``) or attention calls (``selective``) whose attention materializes
#: (B, A, S, S) tensors (eager; the math kernel, which CPU SDPA runs with attention dropout): their saved set is
#: exact, but the step peak is not (estimate/peak.py's block envelope, recomputed tensors + the largest one's
#: gradient, overshoots the real backward: +49,016 B over the trace at B 2, S 64, bf16, eager, full; +32,504 B
#: selective; GPT-NeoX's sequential blocks miss alike), so the estimate refuses them rather than print a wrong peak
_REFUSED_RECOMPUTE_KERNELS = ("eager", "math")
#: recompute modes measured off the trace whatever the kernel (B 2, S 64, n_embd 64, SDPA): ``every-k`` -33,032 B
#: (fp32), ``op`` +32,504 B (fp32)
_REFUSED_RECOMPUTE = ("every-k", "op")


def gpt_bigcode_forward(ctx: Ctx) -> None:
    """``GPTBigCodeForCausalLM.forward``: GPT-2's model forward with this family's block."""
    from trainmem.estimate.rules_hf import _gpt  # the registry imports this module from rules_hf
    _refuse(ctx)
    # GPTBigCodeModel.forward hands its blocks the causal mask but no position ids: a checkpointed block holds none
    _gpt(ctx, _block, positions_to_blocks=False)


def _refuse(ctx: Ctx) -> None:
    """One line for each setting whose step peak was measured off the trace (tests/estimate/test_gpt_bigcode.py)."""
    m, impl, kernel = ctx.model, ctx.impl, resolve_kernel(ctx)
    why = None
    if ctx.finetune_linear is not None:  # a frozen c_proj saves no input; the forward's MLP moment tops
        why = ("fine-tuning (--finetune lora/qlora, --freeze) is not modelled: its step peak read up to 123,640 B "
               "under the trace (LoRA on c_attn, fp32, eager, B 2, S 96, n_embd 128)")
    elif m.head != "lm":  # GPT-2's heads (declared) read the same 65,552 B over at that size
        why = (f"head={m.head!r} is not modelled: its step peak read 65,552 B over the trace (seq-cls, fp32, sdpa, "
               f"B 2, S 64, n_embd 64); estimate the causal LM (--head lm)")
    elif impl.recompute in _REFUSED_RECOMPUTE:
        why = f"recompute={impl.recompute!r} is not modelled: its step peak reads off the trace; use none, selective or full"
    elif impl.recompute in ("full", "selective") and kernel in _REFUSED_RECOMPUTE_KERNELS:
        why = (f"recompute={impl.recompute!r} with attention={impl.attention!r} (the {kernel} kernel, (B, A, S, S) "
               f"tensors) is not modelled: its backward peak is not exact; use --attention flash, or sdpa without "
               f"attention dropout (attn_pdrop=0) on CPU")
    if why:
        raise UnsupportedError(f"{m.name}: gpt_bigcode: {why}")


def _block(ctx: Ctx, x: Sym, kernel: str, cos, sin, held: list[Sym] = ()) -> Sym:
    """``GPTBigCodeBlock.forward``: ln_1, attention, residual, ln_2, MLP, residual."""
    g, m = ctx.graph, ctx.model
    H = m.hidden_size
    h = _layernorm(ctx, x, "ln_1")
    with g.module("attn"):
        a = _attention(ctx, h, kernel, held)
        with g.module("c_proj"):
            a = ctx.linear(a, H, "H", weight=(H, m.q_size), bias=m.out_bias)
        a = ctx.dropout(a, m.hidden_dropout, "resid_dropout", module=True)
    x = ctx.add(a, x, "residual_attn")
    h = _layernorm(ctx, x, "ln_2")
    with g.module("mlp"):  # GPTBigCodeMLP: c_fc, ACT2FN[activation_function], c_proj, dropout
        y = ctx.dropout(_two_matrix_mlp(ctx, h, ("c_fc", "act", "c_proj")), m.hidden_dropout, "dropout", module=True)
    return ctx.add(x, y, "residual_mlp")


def _attention(ctx: Ctx, h: Sym, kernel: str, held: list[Sym]) -> Sym:
    g, m = ctx.graph, ctx.model
    B, S, hd, Akv = ctx.B, ctx.S, m.head_dim, m.num_kv_heads
    width = m.q_size + 2 * m.kv_size
    with g.module("c_attn"):
        qkv = ctx.linear(h, width, "(A+2·Akv)·hd", weight=(width, m.hidden_size), bias=m.qkv_bias)
    q = k = v = qkv  # strided views of the c_attn output
    kept: tuple[Sym, ...] = ()
    if ctx.kv_cache:  # DynamicLayer.update: torch.cat([empty, k]) copies, (B, Akv, S, hd) each
        k = g.new("k_cache", (B, Akv, S, hd), ("B", "Akv", "S", "hd"), qkv.dtype, qkv.requires_grad)
        v = g.new("v_cache", (B, Akv, S, hd), ("B", "Akv", "S", "hd"), qkv.dtype, qkv.requires_grad)
        # eager's matmul reshapes k.transpose(2, 3) and v to (B·A, ...): a view of a contiguous cache with
        # all heads; with one head repeat_kv's expand has stride 0 over the heads, which merges with B only
        # at B == 1 (aten/src/ATen/native/LinearAlgebra.cpp _matmul_impl, TensorShape.cpp computeStride)
        if kernel == "eager" and (Akv == m.num_heads or B == 1):
            kept = (k, v)
    with g.checkpoint(q, k, v, *held) if ctx.impl.recompute == "selective" else nullcontext():
        return attention_core(ctx, q, k, v, kernel=kernel, gqa_native=True, q_copy=kernel in ("eager", "math"),
                              fused=qkv, kept=kept)
