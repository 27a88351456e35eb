"""LitGPT's block variants beyond Llama's: GPT-NeoX (StableLM, Pythia) and Gemma / Gemma-2.

``litgpt/model.py`` runs one ``Block`` for every checkpoint; its ``Config`` picks the pieces
(``norm_class_name``, ``mlp_class_name``, ``parallel_residual``, ``post_attention_norm`` /
``post_mlp_norm``, ``attention_logit_softcapping``, ``rotary_percentage``). :data:`VARIANTS` maps a
family's ``hf`` block rules to the LitGPT block that runs it (a registry: first match wins), and
:func:`litgpt_layer` is what ``rules_hf`` calls for one layer under ``--framework litgpt | lit-gpt``.
Read from litgpt 0.5.13 and checked to the byte against its real ``GPT`` built from its own
``Config.from_name`` (tiny dims) on CPU: ``tests/estimate/test_rules_litgpt_variants.py``.

* ``neox`` (``stablelm-base-alpha-*``, ``pythia-*``: ``LayerNorm``, ``GptNeoxMLP``, parallel residual,
  partial rotary): ``nn.LayerNorm`` keeps what transformers' does (input, mean, rstd); with
  ``parallel_residual`` norm_2 reads the block input too (one input kept, two sets of statistics);
  attention is LitGPT's (``rules_litgpt._attention``: partial RoPE ends in the same ``torch.cat``, so
  q and k are fresh (B, A, S, hd) copies whatever ``rotary_percentage``, and V is a view of the
  fused output, kept whole); ``GptNeoxMLP`` keeps fc's output (GELU's input) and, when proj
  trains, GELU's output. LoRA on the fused ``query_key_value`` is LitGPT's ``LoRAQKVLinear`` over
  the slices named ``q_proj``/``k_proj``/``v_proj`` (:func:`_neox_lora_check`).
* ``gemma`` (``Gemma-*``, ``Gemma-2-*``): ``RMSNorm(add_unit_offset=True)`` (``config.norm_class``:
  ``"Gemma" in name``) keeps a fresh ``(1 + w).float()`` (H,) fp32 whatever the weight's dtype;
  ``GemmaMLP`` is ``LLaMAMLP`` with tanh-GELU (the same saved set); Gemma-2's
  ``post_attention_norm`` / ``post_mlp_norm`` are two more RMSNorms on the attention and MLP outputs;
  ``attention_logit_softcapping`` takes the eager path (:func:`_softcap_core`).

Known limitations: no ``shared_attention_norm`` (norm_1's output feeding the MLP too: read as two
norms here), no q/k norm, MoE, MLA or ``LLaMAMoE``; Gemma-2's sliding-window layers build their (S, S) mask without keeping it (no
saved tensor; the transient is not modelled); the 0-d ``sqrt(H)`` tensor the embedding scaling
keeps when the embedding trains (2 bytes) is not counted. Gemma and Gemma-2 were added to LitGPT
in 2024: refused under ``--framework lit-gpt`` (8641822). GPT-NeoX under ``lit-gpt`` runs the same
modules (``lit_gpt/model.py`` at 8641822: ``nn.LayerNorm``, ``GptNeoxMLP``, ``x + h + mlp(n_2)``).
"""

from __future__ import annotations

from typing import Callable

from trainmem.errors import SpecError, UnsupportedError
from trainmem.estimate.ctx import Ctx
from trainmem.estimate.finetune import lora_targeted
from trainmem.estimate.graph import Sym
from trainmem.estimate.rules_hf_parts import _activation, _gated_mlp, _layernorm, _rules
from trainmem.estimate.rules_litgpt import _attention, check_run, litgpt_block, litgpt_rmsnorm
from trainmem.estimate.rules_prenorm import prenorm_block

__all__ = ["VARIANTS", "litgpt_layer"]


def _neox_lora_check(ctx: Ctx) -> None:
    """LitGPT's LoRA on GPT-NeoX's fused projection adapts slices (``lora_query`` / ``lora_key`` /
    ``lora_value``): ``--lora-targets query_key_value,q_proj,v_proj`` (the module for the parameters, the
    slices for the block). Its adapters are ``lora_A`` (n·r, H) and ``lora_B`` (n·H, r), where peft's on
    the whole module are (r, H) and (3H, r): the same count only for two slices, so only that is modelled."""
    spec = getattr(ctx.finetune_linear, "spec", None)
    if spec is None or not spec.adapters:
        return
    g = ctx.graph
    whole = lora_targeted(g.path("query_key_value"), spec)
    n = sum(lora_targeted(g.path(s), spec) for s in ("q_proj", "k_proj", "v_proj"))
    if whole != (n > 0) or n not in (0, 2):
        raise SpecError("lora_targets", ",".join(spec.lora_targets),
                        "--framework litgpt on GPT-NeoX: name the fused module and two of LitGPT's slices, e.g. "
                        "query_key_value,q_proj,v_proj (lora_query, lora_value); one or three slices have another "
                        "adapter size than peft's whole-module LoRA and are not modelled")


def neox_block(ctx: Ctx, x: Sym, cos: Sym, sin: Sym, kernel: str, *, masked: bool = False,
               moe: bool = False) -> Sym:
    """litgpt/model.py ``Block.forward`` with ``LayerNorm`` and ``GptNeoxMLP`` (HF GPT-NeoX names)."""
    g, m = ctx.graph, ctx.model
    H, F = m.hidden_size, m.ffn_size
    check_run(ctx, kernel, masked)
    h = _layernorm(ctx, x, "input_layernorm")
    with g.module("attention"):
        _neox_lora_check(ctx)
        a = _attention(ctx, h, cos, sin, kernel, out_name="dense")
    if m.parallel_residual:  # norm_2(x) on the block input; x = attention_output + x
        h2 = _layernorm(ctx, x, "post_attention_layernorm")
        x = ctx.add(x, a, "residual_attn")
    else:
        x = ctx.add(x, a, "residual_attn")
        h2 = _layernorm(ctx, x, "post_attention_layernorm")
    with g.module("mlp"):  # GptNeoxMLP: fc, F.gelu(approximate=config.gelu_approximate), proj
        with g.module("dense_h_to_4h"):
            u = ctx.linear(h2, F, "F", weight=(F, H), bias=m.mlp_bias)
        with g.module("act"):
            u = _activation(ctx, u, "act")
        with g.module("dense_4h_to_h"):
            y = ctx.linear(u, H, "H", weight=(H, F), bias=m.mlp_bias)
    return ctx.add(x, y, "residual_mlp")


def _softcap_core(ctx: Ctx, q: Sym, k: Sym, v: Sym) -> Sym:
    """``CausalSelfAttention.scaled_dot_product_attention`` with ``attention_logit_softcapping``:
    ``q @ k.mT * scale`` (matmul keeps q and k; both contiguous, so the bmm operands are views),
    ``tanh(s / cap) * cap`` (tanh keeps its output), ``+ mask`` (built, not kept),
    ``F.softmax(dtype=torch.float)`` (aten ``softmax``: a 16-bit input is converted to fp32 first and
    ``_softmax`` keeps its fp32 output), ``.to(q.dtype)`` and ``@ v``, which keeps the cast
    probabilities and v: a fresh heads-wide copy when v is still a view of the fused qkv (MHA:
    the transposed view cannot fold B and A into bmm's batch)."""
    g, m = ctx.graph, ctx.model
    B, S, A, hd = ctx.B, ctx.S, m.num_heads, m.head_dim
    rg = q.requires_grad or k.requires_grad
    scores, sdims = (B, A, S, S), ("B", "A", "S", "S")
    g.save(q, when=k.requires_grad)
    g.save(k, when=q.requires_grad)
    g.new("scores", scores, sdims, q.dtype, rg, op="bmm")
    g.save(g.new("softcap_tanh", scores, sdims, q.dtype, rg), when=rg)
    p32 = g.new("softmax", scores, sdims, "float32", rg)
    g.save(p32, when=rg)
    probs = ctx.cast(p32, q.dtype, "probs")
    if v.shape != (B, A, S, hd):
        v = g.new("v_copy", (B, A, S, hd), ("B", "A", "S", "hd"), v.dtype, v.requires_grad)
    g.save(probs, when=v.requires_grad)
    g.save(v, when=probs.requires_grad)
    return g.new("pv", (B, A, S, hd), ("B", "A", "S", "hd"), v.dtype, rg or v.requires_grad, op="bmm")


def gemma_block(ctx: Ctx, x: Sym, cos: Sym, sin: Sym, kernel: str, *, masked: bool = False,
                moe: bool = False) -> Sym:
    """litgpt/model.py ``Block.forward`` for Gemma / Gemma-2 (non-parallel residual, HF names)."""
    m, rules = ctx.model, _rules(ctx)
    if ctx.impl.framework == "lit-gpt":
        raise UnsupportedError(f"{m.name}: lit_gpt 8641822 (--framework lit-gpt) has no Gemma; use --framework litgpt")
    if m.qk_norm or not m.gated or moe:
        raise UnsupportedError(f"{m.name}: --framework litgpt models Gemma's GemmaMLP blocks without q/k norms")
    if m.attn_softcap:  # LitGPT takes the eager path whatever --attention says; its sliding-window
        check_run(ctx, "flash", False)  # mask is added to the scores, not kept
        core = _softcap_core
    else:
        check_run(ctx, kernel, masked)
        core = None

    def norm(v: Sym, name: str) -> Sym:
        return litgpt_rmsnorm(ctx, v, name)

    sandwich = rules.sandwich_norms  # Gemma-2's post-attention and post-feedforward norms
    # GemmaMLP: gelu(fc_1(x), approximate="tanh") * fc_2(x) keeps what LLaMAMLP keeps
    return prenorm_block(ctx, x, norm, lambda h: _attention(ctx, h, cos, sin, kernel, core=core),
                         lambda h: _gated_mlp(ctx, h),
                         mlp_norm="pre_feedforward_layernorm" if sandwich else "post_attention_layernorm",
                         out_norm=norm if sandwich else None)


VARIANTS: tuple[tuple[str, Callable, Callable], ...] = (
    ("neox", lambda rules: rules.neox, neox_block),
    ("gemma", lambda rules: rules.unit_offset_norm, gemma_block),
    ("llama", lambda rules: rules.forward == "llama", litgpt_block),
)
"""(name, which ``BlockRules`` it runs, the block rule): LitGPT's ``Block`` per ``Config`` style."""


def litgpt_layer(ctx: Ctx, x: Sym, cos: Sym, sin: Sym, kernel: str, held: list[Sym] = (), *,
                 masked: bool = False, moe: bool = False) -> Sym:
    """One LitGPT block for this family (:data:`VARIANTS`); refuses what none of them runs."""
    rules = _rules(ctx)
    for _name, runs, block in VARIANTS:
        if runs(rules):
            return block(ctx, x, cos, sin, kernel, masked=masked, moe=moe)
    raise UnsupportedError(f"{ctx.model.name}: --framework litgpt has no LitGPT block for {ctx.model.family}")
