"""``ImplSpec.compile``: what ``torch.compile`` keeps for backward in a Llama-family decoder.

Inductor partitions each compiled region's joint graph with a min-cut that recomputes cheap
pointwise ops in backward (``torch/_functorch/partitioners.py``
``min_cut_rematerialization_partition``, called from ``torch/_inductor/compile_fx.py``
``partition_fn``). Read from the partitioned graphs of transformers' ``LlamaForCausalLM``
(``trainmem.trace.compiled``, the same partition as inductor's, whose C++ build saved the same
set), against the eager rules of ``rules_hf``:

* RMSNorm keeps its input (not the attention's residual sum: see below), ``rsqrt`` (fp32, B·S·1)
  and its output (the next linear's input); the normalized product (and, for 16-bit inputs,
  the fp32 copy) is recomputed;
* the rotary ``cos``/``sin`` are recomputed from ``inv_freq`` (fp32, hd/2), which is kept: the
  buffer itself, counted once in the ``buffer`` ledger (``estimate/buffers.py``), never here;
* attention keeps what the SDPA kernel saves (it is not decomposed) and ``o_proj``'s output,
  from which the residual sum is recomputed;
* SwiGLU keeps ``gate``, ``up`` and ``act(gate)·up``; the activation's output is recomputed;
* the loss keeps the logits in their own dtype, the row max and the log-sum-exp (fp32,
  B·S·1 each), the labels padded to S+1 and the token count, instead of the fp32
  ``log_softmax`` output and the shifted targets.

Scope: what was checked (``tests/estimate/test_compiled_rules.py``): dense Llama-family models
(Qwen2's q/k/v biases and grouped K/V heads included; no q/k norms), one device, pure fp32/bf16/fp16,
fused attention kernels, no activation checkpointing or ``--recompute full``
(:func:`_checkpointed_layers`), no fine-tuning but in fully recomputed per-block regions
(:func:`_recomputed_blocks`). Per-block compilation: :func:`_per_block`. Anything else is refused by name
(:func:`check_compiled`).
"""

from __future__ import annotations

from importlib import import_module

from trainmem.errors import UnsupportedError
from trainmem.estimate.attention import attention_core, resolve_kernel, window_mask
from trainmem.estimate.compiled_float8_op import gathered_scales, op_float8_scalars
from trainmem.estimate.compiled_cp import compiled_cp_refusals
from trainmem.estimate.compiled_tp import compiled_tp_refusals
from trainmem.estimate.ctx import Ctx, Shard
from trainmem.estimate.float8 import compiled_input_recomputed, compiled_scales
from trainmem.estimate.graph import OpPolicy, Sym
from trainmem.estimate.loss_value import loss_value
from trainmem.estimate.rules_compiled_attention import compiled_eager_attention, eager_checked, eager_mask
from trainmem.estimate.rules_compiled_moe import (checkpointed_moe_arange, compiled_load_balancing, compiled_moe,
                                                  router_checked)
from trainmem.estimate.rules_compiled_olmo2 import olmo2_block
from trainmem.estimate.rules_hf_parts import _embedding, _head, _layers, _loss
from trainmem.estimate.rules_hf_parts import _rmsnorm as _eager_rmsnorm
from trainmem.families import families, family_of
from trainmem.names import EMBEDDING_INDICES, EMBEDDING_OUTPUT

__all__ = ["compiled_forward", "check_compiled"]

#: families whose compiled rules live in a module of their own (imported on use: it imports this one), each
#: with ``forward(ctx)`` and ``refusals(ctx)`` (check_compiled's rows); the Llama block's checks do not apply
_OWN_RULES = {"gpt2": "trainmem.estimate.rules_compiled_gpt2"}

# the families with Family.compiled_rules (families/); a sliding window shorter than S is refused:
# there the compiled step keeps a mask and another kernel's set (a tiny Mistral, window 32, S=64:
# 1685044 bytes traced, 1586740 by these rules)


def check_compiled(ctx: Ctx) -> None:
    """Refuse what the compiled rules have not been checked on, naming the field and value."""
    m, step, impl = ctx.model, ctx.step, ctx.impl
    fam = family_of(m)
    own = import_module(_OWN_RULES[fam.name]) if fam.compiled_rules and fam.name in _OWN_RULES else None
    refusals = [
        ("profile", impl.profile, impl.profile != "hf", "compiled rules follow Hugging Face modules (--profile hf)"),
        ("model", m.family, not fam.compiled_rules or own is None and (m.num_shared_experts
                             or m.activation not in ("swiglu", "geglu")  # Gemma's GELU-tanh gate keeps what SiLU's does
                             or m.out_bias or m.mlp_bias or m.norm_bias
                             or any(window_mask(ctx, k) for k in set(m.kinds))),
         f"compiled rules cover {'/'.join(compiled_families())} (SwiGLU/GeGLU blocks with q/k/v biases at most, no "
         "sliding window shorter than S; GPT-2's block: estimate/rules_compiled_gpt2.py)"),
        ("model", m.family, m.is_moe and (step.recipe != "bf16" or impl.recompute not in ("none", "full")
                                          or impl.float8 != "none" or ctx.finetune_linear is not None
                                          or not router_checked(m.num_experts)),
         "compiled MoE rules (estimate/rules_compiled_moe.py) cover bf16 grouped_mm experts at --recompute none "
         "or full, no fine-tuning or Float8, routers of at most 16 or at least 32 experts (torch 2.13's grouped_mm "
         "meta kernel is bf16 only; trace --compile)"),
        ("precision", step.precision, step.recipe not in ("fp32", "bf16", "fp16", "fsdp-bf16") and not (
            step.recipe == "amp-bf16" and impl.compile_scope != "model"),
         "compiled rules cover pure fp32/bf16/fp16 (fsdp-bf16's gathered weights: bf16), and amp-bf16 with "
         "--compile-scope block or block-loss"),
        ("loss", step.loss, step.loss != "ce" and not (step.loss == "torchtune-chunked-ce" and impl.compile_scope != "model"),
         "compiled rules cover the full cross-entropy, and torchtune's chunked one with --compile-scope block "
         "(loss eager) or block-loss (estimate/compiled_chunk_loss.py)"),
        ("recompute", impl.recompute, impl.recompute not in ("none", "full") and not (
            impl.recompute == "op" and impl.compile_scope != "model" and not m.qk_norm
            # amp-bf16: the moments of compiled_recompute.py less the weight casts of the kept mms
            # (compiled_op_moment.py uncast_linears), traced on one device, FSDP2 and HSDP; with Float8 tensorwise
            # those of compiled_float8_recompute.py (one device, FSDP2, the fp8 all-gather). Per pipeline stage:
            # compiled_sharded.py
            and (step.recipe in ("fp32", "bf16", "fp16", "fsdp-bf16")
                 or step.recipe == "amp-bf16" and impl.float8 in ("none", "tensorwise"))),
         "compiled rules cover --recompute none and full, and op per block in fp32/bf16/fp16, fsdp-bf16 and "
         "amp-bf16 (with --float8 tensorwise or without Float8; the CUDA SDPA outputs the policy keeps: checked with "
         "the CPU kernel standing in, docs/compile.md)"),
        # before the kernel: dropout turns SDPA into its math ops (GPT-2, CPU: a bool mask per dropout kept too)
        ("dropout", max(m.attn_dropout, m.hidden_dropout), m.attn_dropout > 0 or m.hidden_dropout > 0,
         "compiled rules have no dropout (nanoGPT's 0.0: --model a config.json with its dropout keys at 0.0; "
         "docs/compile.md)"),
        ("attention", impl.attention, resolve_kernel(ctx) not in ("flash", "efficient") and not (
            resolve_kernel(ctx) == "eager" and eager_checked(ctx)),
         "compiled rules need a fused attention kernel (sdpa, flash, mem-efficient), or eager attention in bf16 or fp32 "
         "at --recompute none with more than one K/V head in the Llama block (estimate/rules_compiled_attention.py)"),
        *compiled_cp_refusals(ctx),  # before the generic row: CP's own reason (estimate/compiled_cp.py)
        ("parallel", "sharded", ctx.shard != Shard() and ctx.shard.tp == 1, "compiled rules cover one device's "
         "shapes, FSDP2 (--dp N --fsdp full: estimate/compiled_sharded.py) and TP (estimate/compiled_tp.py), not "
         "context or expert parallelism"),
        *compiled_tp_refusals(ctx),
        ("finetune", _finetune_mode(ctx), _finetune_mode(ctx) not in ("off", "full", "lora", "qlora") or (
            ctx.finetune_linear is not None and not _recomputed_blocks(ctx)) or (
            _finetune_mode(ctx) == "qlora" and ctx.finetune_linear.spec.quant_impl != "torchao-nf4"),
         "compiled rules cover full, LoRA and torchao-nf4 QLoRA fine-tuning with --recompute full and "
         "--compile-scope block or block-loss (a checkpointed compiled block keeps its input: "
         "tests/estimate/test_compiled_chunk_loss.py)"),
        # per block the recorded router logits break each block graph into regions (estimate/rules_compiled_moe.py)
        ("output_router_logits", m.router_aux_loss, m.router_aux_loss and (
            impl.compile_scope != "model" or impl.recompute != "none"),
         "the compiled load-balancing loss is read under whole-model compile at --recompute none (trace --compile)"),
        ("compile_scope", impl.compile_scope, impl.compile_scope not in fam.compiled_scopes,
         f"{m.family}'s compiled rules are checked with --compile-scope {'/'.join(fam.compiled_scopes)} (Gemma-3 "
         "under whole-model compile also keeps each block's residual sum: +12288 B per tiny bf16 block, traced)"),
        ("softcap", max(m.attn_softcap, m.logit_softcap), (m.attn_softcap > 0 or m.logit_softcap > 0) and not (
            resolve_kernel(ctx) == "eager" and impl.compile_scope != "model"),
         "compiled rules cover tanh soft-capping (Gemma-2) with eager attention per block (--compile-scope block or "
         "block-loss: the capped scores are recomputed from the saved ones, the capped logits are eager)"),
        ("model", m.family, fam.compiled_narrow and (
            impl.recompute not in ("none", "full") or (impl.recompute == "full" and impl.compile_scope == "model") or step.recipe not in ("fp32", "bf16", "fp16") or impl.float8 != "none"
            or ctx.finetune_linear is not None or m.qkv_bias),
         f"compiled rules for {m.family} cover --recompute none, pure fp32/bf16/fp16, no fine-tuning, Float8 or "
         "q/k/v biases (trace --compile)"),
        ("float8", impl.float8, impl.float8 != "none" and (
            impl.compile_scope == "model" or impl.recompute not in ("none", "full", "op")
            or step.recipe not in ("fp32", "bf16", "fp16", "amp-bf16", "fsdp-bf16") or m.qk_norm or m.qkv_bias
            # rowwise at none: its backward is replayed in bf16 (estimate/compiled_float8_rowwise.py; without it the
            # tiny Llama's step read 0.882 of the trace in fp16, 0.964 in fp32, 0.972 in amp-bf16)
            or impl.float8 == "rowwise" and step.recipe not in ("bf16", "fsdp-bf16")
            # a checkpointed block's backward moments (estimate/compiled_float8_recompute.py): tensorwise, and rowwise
            # under full (compiled_float8_rowwise_recompute.py) and op (compiled_float8_rowwise_op.py), the Llama block
            # (SiLU, two RMSNorms), all converted
            # and FSDP2's fp8 all-gather (its saved weight copies: compiled_float8_gathered.py; the attention's input
            # gradients summed beside the block's weight gradients: compiled_float8_moment.py, in a checkpointed block
            # too, compiled_float8_recompute.py), traced in every precision
            or (impl.recompute in ("full", "op") or impl.float8_all_gather) and (
                impl.float8 != "tensorwise" and not (impl.float8 == "rowwise" and impl.recompute in ("full", "op"))
                or ctx.shard != Shard()
                or m.activation != "swiglu" or any(d % 16 for d in (m.hidden_size, m.q_size, m.kv_size, m.ffn_size))
                or any(getattr(family_of(m).rules, r) for r in ("unit_offset_norm", "sandwich_norms", "fused_qkv",
                                                                 "fused_gate_up", "post_norms")))),
         "compiled Float8 rules cover --compile-scope block or block-loss, fp32/bf16/fp16/amp-bf16/fsdp-bf16 (rowwise: "
         "bf16/fsdp-bf16), --recompute none, full or op (full, op and the fp8 all-gather: the Llama block with every "
         "linear converted), no q/k norms or biases "
         "(estimate/float8.py, estimate/compiled_float8_recompute.py, compiled_float8_op.py; trace --compile)"),
        *(own.refusals(ctx) if own else ()),
    ]
    for field, value, bad, why in refusals:
        if bad:
            raise UnsupportedError(f"compile: {field}={value!r} is not modelled: {why}")


def _block_rule(ctx: Ctx):
    """``(i, x) -> output``: OLMo-2's compiled block for its post-norms (``BlockRules.post_norms``), else the
    Llama one, with the MoE MLP in block ``i`` where its kind has one (``rules_compiled_moe.py``)."""
    if family_of(ctx.model).rules.post_norms:
        return lambda _i, x: olmo2_block(ctx, x)
    return lambda i, x: _compiled_block(ctx, x, moe=ctx.model.kind(i).mlp == "moe")


def compiled_families() -> list[str]:
    """The families the compiled rules cover (``Family.compiled_rules``)."""
    return [f.name for f in families() if f.compiled_rules]


def _recomputed_blocks(ctx: Ctx) -> bool:
    """Blocks compiled alone around a full checkpoint: what runs inside them (LoRA or 4-bit
    linears) is recomputed, the eager rest follows the eager rules, fine-tuning included."""
    return ctx.impl.recompute == "full" and ctx.impl.compile_scope != "model"


def _finetune_mode(ctx: Ctx) -> str:
    spec = getattr(ctx.finetune_linear, "spec", None)
    return "off" if ctx.finetune_linear is None else getattr(spec, "mode", "on")


def compiled_forward(ctx: Ctx) -> None:
    check_compiled(ctx)
    if family_of(ctx.model).name in _OWN_RULES:
        return import_module(_OWN_RULES[family_of(ctx.model).name]).forward(ctx)
    if ctx.impl.compile_scope != "model":
        return _per_block(ctx)
    g, m = ctx.graph, ctx.model
    B, S, H, hd = ctx.B, ctx.S, m.hidden_size, m.head_dim
    a = ctx.param  # pure precisions: weights and activations in one dtype
    with g.module("model.embed_tokens"):
        g.save(g.new(EMBEDDING_INDICES, (B, S), ("B", "S"), "int64", False))
        x = g.new(EMBEDDING_OUTPUT, (B, S, H), ("B", "S", "H"), a)
    # model.rotary_emb: the graph saves inv_freq itself, a buffer (estimate/buffers.py), not an activation
    if ctx.impl.recompute == "full":
        _checkpointed_layers(ctx, x)
        return _head_and_loss(ctx, g.new("residual_mlp", (B, S, H), ("B", "S", "H"), a), keep_input=False)
    _head_and_loss(ctx, _layers(ctx, "model.layers.", x, _block_rule(ctx)))
    if m.router_aux_loss:  # after the cross-entropy (estimate/rules_compiled_moe.py)
        compiled_load_balancing(ctx)


def _compiled_block(ctx: Ctx, x: Sym, *, moe: bool = False) -> Sym:
    """One decoder block's saved set inside a compiled region (its input ``x`` included). Under
    autocast (amp-bf16, per-block scopes only) the block's input stays in the weights' dtype and
    everything the linears make or read is in autocast's dtype, plus the 16-bit weight copies."""
    g, m = ctx.graph, ctx.model
    B, S, H, A, Akv, F = ctx.B, ctx.S, m.hidden_size, "A·hd", "Akv·hd", m.ffn_size
    a = ctx.low or ctx.param  # the activations' dtype (pure precisions: the weights')
    rules = family_of(m).rules
    fused = rules.fused_gate_up  # Phi-3: fused qkv_proj and gate_up_proj (checked pure only)
    sandwich = rules.sandwich_norms  # Gemma-3: a norm on o_proj's and down_proj's outputs, the MLP's is pre_feedforward
    qkv = (("self_attn.q_proj", (m.q_size, H)), ("self_attn.k_proj", (m.kv_size, H)),
           ("self_attn.v_proj", (m.kv_size, H)))
    mlp = (("mlp.gate_proj", (F, H)), ("mlp.up_proj", (F, H)))
    # Float8 (estimate/float8.py): a converted linear's input is recomputed when pointwise in what is kept
    _rmsnorm(ctx, x, "input_layernorm", keep_output=not compiled_input_recomputed(ctx, *qkv))
    with g.module("self_attn"):
        _weight_copies(ctx, ("q_proj", m.q_size, A, H, "H"), ("k_proj", m.kv_size, Akv, H, "H"),
                       ("v_proj", m.kv_size, Akv, H, "H"), ("o_proj", H, "H", m.q_size, A))
        if m.qk_norm:  # Qwen3: per-head RMSNorm of q and k keeps its input (the projection) and rsqrt
            _head_norm_inputs(ctx, ("q_proj", "q_norm", m.q_size, A, m.num_heads, "A"),
                              ("k_proj", "k_norm", m.kv_size, Akv, m.num_kv_heads, "Akv"))
        q = g.new("q_rope", (B, S, m.q_size), ("B", "S", A), a)
        k = g.new("k_rope", (B, S, m.kv_size), ("B", "S", Akv), a)
        with g.module("qkv_proj" if fused else "v_proj"):  # Phi-3: v, a contiguous copy of its qkv slice
            v = g.new("v" if fused else "out", (B, S, m.kv_size), ("B", "S", Akv), a)
        if resolve_kernel(ctx) == "eager":  # --attention eager: keeps o_proj's input
            compiled_eager_attention(ctx, q)
        else:
            attention_core(ctx, q, k, v, kernel=resolve_kernel(ctx), gqa_native=m.head_dim <= 256)  # keeps o_proj's input
        with g.module("o_proj"):  # the residual sum is recomputed from it (under SP: its reduce-scattered S/tp)
            g.save(ctx.sp_scatter(g.new("out", (B, S, H), ("B", "S", "H"), a), "out_sp"))
    if sandwich:  # the norm of o_proj's output keeps its rsqrt; the normalized output is recomputed
        _rsqrt(ctx, "post_attention_layernorm")
    residual = g.new("residual_attn", x.shape, x.dims, x.dtype)  # SP: S/tp, as the block input
    _rmsnorm(ctx, residual, "pre_feedforward_layernorm" if sandwich else "post_attention_layernorm", keep_input=False,
             keep_output=not compiled_input_recomputed(ctx, *mlp))
    with g.module("mlp"):
        if moe:  # the router and grouped_mm experts (Qwen3-MoE, Mixtral; bf16, no autocast copies)
            compiled_moe(ctx)
            return g.new("residual_mlp", x.shape, x.dims, x.dtype)
        _weight_copies(ctx, ("gate_proj", F, "F", H, "H"), ("up_proj", F, "F", H, "H"), ("down_proj", H, "H", F, "F"))
        # Phi-3's gate_up_proj: one output, of which gate and up are views
        for name, width, sym in (("gate_up_proj", 2 * F, "2·F"),) if fused else (("gate_proj", F, "F"),
                                                                                  ("up_proj", F, "F")):
            with g.module(name):
                g.save(g.new("out", (B, S, width), ("B", "S", sym), a))
        g.save(g.new("act_mul_up", (B, S, F), ("B", "S", "F"), a),  # down_proj's input
               when=not compiled_input_recomputed(ctx, ("down_proj", (H, F))))
        if sandwich:  # post_feedforward_layernorm's input
            with g.module("down_proj"):
                g.save(g.new("out", (B, S, H), ("B", "S", "H"), a))
    if sandwich:
        _rsqrt(ctx, "post_feedforward_layernorm")
    compiled_scales(ctx, *qkv, ("self_attn.o_proj", (H, m.q_size)), *mlp, ("mlp.down_proj", (H, F)))
    return g.new("residual_mlp", x.shape, x.dims, x.dtype)


def _rsqrt(ctx: Ctx, norm: str) -> None:
    """A norm whose input the block keeps anyway: its fp32 ``rsqrt`` (B·S·1)."""
    with ctx.graph.module(norm):
        ctx.graph.save(ctx.graph.new("rsqrt", (ctx.B, ctx.S, 1), ("B", "S", "1"), "float32", False))


def _head_norm_inputs(ctx: Ctx, *norms: tuple) -> None:
    """Qwen3's q/k RMSNorm over each head, ``(proj, norm, width, width_sym, heads, heads_sym)``:
    the compiled block keeps the projection's output and the fp32 ``rsqrt`` per head (B·S·heads);
    the normalized product is recomputed, as in the block's other norms."""
    g = ctx.graph
    B, S, a = ctx.B, ctx.S, ctx.low or ctx.param
    for proj, norm, width, width_sym, heads, heads_sym in norms:
        with g.module(proj):
            g.save(g.new("out", (B, S, width), ("B", "S", width_sym), a))
        with g.module(norm):
            g.save(g.new("rsqrt", (B, S, heads, 1), ("B", "S", heads_sym, "1"), "float32", False))


def _weight_copies(ctx: Ctx, *linears: tuple) -> None:
    """Autocast's 16-bit copy of each linear's weight, ``(name, out, out_sym, in, in_sym)``: the
    partitioned backward's mm reads it (eager autograd keeps it too: ``Ctx.plain_linear``)."""
    g = ctx.graph
    for name, out, out_sym, inp, in_sym in linears if ctx.low else ():
        with g.module(name):
            g.save(g.new("weight_cast", (out, inp), (out_sym, in_sym), ctx.low, False),
                   when=ctx.impl.float8 == "none" or not ctx.float8_converts((out, inp)))  # Float8Linear: no copy


def _per_block(ctx: Ctx) -> None:
    """``compile_scope='block'`` (torchtitan's ``apply_compile``, torchtune's ``compile_model``;
    ``trace/compiled.py`` ``_compile_blocks``): each decoder block is its own compiled region and
    keeps what :func:`_compiled_block` keeps; the embedding, rotary table, final norm, head and loss
    run eager and keep what the eager rules keep (``rules_hf``). The eager rotary ``cos``/``sin``
    (computed under ``no_grad`` in ``LlamaRotaryEmbedding.forward``, in the activation dtype)
    enter every block as inputs and are kept once (one storage each); ``inv_freq`` is not kept.
    Under ``--recompute full`` each block keeps its input only (:func:`_checkpointed_block`)."""
    g, m = ctx.graph, ctx.model
    x = _embedding(ctx, "model.embed_tokens")
    with g.module("model.embed_tokens"):  # SP: the vocab-parallel embedding reduce-scatters (estimate/compiled_tp.py)
        x = ctx.sp_scatter(x, "out_sp")
    rules = family_of(m).rules
    with g.module("model.rotary_emb"):
        rot, dt = (1, ctx.S, m.head_dim), "float32" if rules.rope_fp32 else x.dtype  # OLMo-2: fp32
        # Gemma-3: one table per layer type (Gemma3RotaryEmbedding.forward(layer_type)), each passed to its blocks
        for sfx in (f"_{t}" for t in sorted({k.attention for k in m.kinds})) if rules.rope_per_layer_type else ("",):
            g.save(g.new(f"cos{sfx}", rot, ("1", "S", "hd"), dt, False),
                   g.new(f"sin{sfx}", rot, ("1", "S", "hd"), dt, False))
    if resolve_kernel(ctx) == "eager":
        eager_mask(ctx)
    recomputed_rule = {"full": _checkpointed_block, "op": _op_block}.get(ctx.impl.recompute)
    x = _layers(ctx, "model.layers.", x, (lambda _i, x: recomputed_rule(ctx, x)) if recomputed_rule else _block_rule(ctx))
    h = _eager_rmsnorm(ctx, x, "model.norm", gemma=family_of(m).rules.unit_offset_norm)
    with g.module("lm_head"):  # SP: the head's input all-gathered (estimate/compiled_tp.py)
        h = ctx.sp_gather(h, "input_gathered")
    logits = _head(ctx, h, "lm_head")
    if ctx.impl.compile_scope == "block-loss":  # torchtune's compile_loss: the loss is its own region
        if ctx.step.loss == "torchtune-chunked-ce":  # each chunk's compute_cross_entropy compiled alone
            from trainmem.estimate.compiled_chunk_loss import compiled_chunk_items
            return compiled_chunk_items(ctx, logits)
        return _compiled_loss(ctx, logits)
    _loss(ctx, logits)


def _op_block(ctx: Ctx, x: Sym) -> Sym:
    """A block compiled alone around torchtitan's op-level checkpoint (``--recompute op``,
    ``estimate/graph.py`` ``OpPolicy``: the block's 1st, 3rd, 5th... mm and every addmm are kept,
    the rest recomputed, ``must_save`` tags the partitioner honours). Of the kept outputs the
    compiled block holds those its backward reads: q, k, v, o and the MLP's gate and up
    projections, not ``down_proj``'s (only the residual sum, whose gradient needs nothing, reads it).
    It keeps its input, and the CPU generator state its recomputed SDPA replays (host memory, left
    out). On CPU the SDPA kernel is not on the policy's list; on CUDA the flash and memory-efficient ones are, and
    their output and log-sum-exp are kept (:func:`_op_attention`; checked by putting the CPU kernel on both the
    trace's and this list: tests/estimate/test_compiled_op_cuda.py). Tiny Llama bf16: q, v and gate per block
    (on CUDA, with the SDPA output and log-sum-exp). The backward's moment: estimate/compiled_op_moment.py."""
    g, m = ctx.graph, ctx.model
    B, S, H, F, a = ctx.B, ctx.S, m.hidden_size, m.ffn_size, ctx.param
    policy = OpPolicy()
    g.save(x)
    linears = (("self_attn.q_proj", m.q_size, "A·hd", m.qkv_bias), ("self_attn.k_proj", m.kv_size, "Akv·hd",
                                                                       m.qkv_bias),
               ("self_attn.v_proj", m.kv_size, "Akv·hd", m.qkv_bias), ("self_attn.o_proj", H, "H", m.out_bias),
               ("mlp.gate_proj", F, "F", m.mlp_bias), ("mlp.up_proj", F, "F", m.mlp_bias),
               ("mlp.down_proj", H, "H", m.mlp_bias))
    kept_mm = {}
    for name, width, sym, bias in linears:
        if name == "self_attn.o_proj":  # the SDPA kernel runs between v_proj and o_proj
            _op_attention(ctx, policy)
        kept_mm[name] = policy.save("addmm" if bias else "mm")
        if kept_mm[name] and name != "mlp.down_proj":
            with g.module(name):  # under autocast the mm's output is autocast's dtype (ctx.low)
                g.save(g.new("out", (B, S, width), ("B", "S", sym), ctx.low or a))
    # Float8 tensorwise: the amaxes and inverse scales the backward reads (estimate/compiled_float8_op.py)
    op_float8_scalars(ctx, kept_mm, {n: (w, m.q_size if n == "self_attn.o_proj" else F if n == "mlp.down_proj" else H)
                                     for n, w, _, _ in linears})
    return g.new("residual_mlp", (B, S, H), ("B", "S", "H"), x.dtype)


def _op_attention(ctx: Ctx, policy: OpPolicy) -> None:
    """The fused SDPA kernel's outputs where the policy keeps them (the CUDA flash and memory-efficient kernels,
    ``graph.SAVED_OPS``; not the CPU one): its output and fp32 log-sum-exp, as ``attention.fused_saves`` names
    them (the memory-efficient kernel pads the latter to a multiple of 32 queries). Its q, k, v inputs are
    recomputed."""
    g, kernel = ctx.graph, resolve_kernel(ctx)
    B, S, A = ctx.B, ctx.S, ctx.model.num_heads
    if kernel not in ("flash", "efficient") or not policy.save(f"sdpa_{kernel}" + ("_cpu" if ctx.impl.device == "cpu"
                                                                                     else "")):
        return
    rows = S if kernel == "flash" else -(-S // 32) * 32
    with g.module("self_attn"):
        g.save(g.new("sdpa_out", (B, S, ctx.model.q_size), ("B", "S", "A·hd"), ctx.param),
               g.new("lse", (B, A, rows), ("B", "A", "S" if kernel == "flash" else "⌈S/32⌉·32"), "float32", False))


def _checkpointed_block(ctx: Ctx, x: Sym) -> Sym:
    """A block compiled alone around its checkpoint (torchtitan: ``apply_ac`` wraps the block, then
    ``apply_compile`` compiles the wrapper): the region keeps its input (and the CPU generator state
    its recomputed SDPA replays, host memory, left out as in :func:`_checkpointed_layers`); the
    rotary table it also reads is the eager one, kept once."""
    ctx.graph.save(x)
    m = ctx.model  # --float8-all-gather: each gathered fp8 weight's scale (estimate/compiled_float8_op.py)
    gathered_scales(ctx, {"self_attn.q_proj": (m.q_size, m.hidden_size), "self_attn.k_proj": (m.kv_size, m.hidden_size),
                          "self_attn.v_proj": (m.kv_size, m.hidden_size), "self_attn.o_proj": (m.hidden_size, m.q_size),
                          "mlp.gate_proj": (m.ffn_size, m.hidden_size), "mlp.up_proj": (m.ffn_size, m.hidden_size),
                          "mlp.down_proj": (m.hidden_size, m.ffn_size)})
    return ctx.graph.new("residual_mlp", x.shape, x.dims, x.dtype)


def _head_and_loss(ctx: Ctx, x: Sym, *, keep_input: bool = True) -> None:
    """The final norm, ``lm_head``'s output and what the compiled cross-entropy keeps."""
    g = ctx.graph
    B, S, V, a = ctx.B, ctx.S, ctx.model.vocab_size, ctx.param
    _rmsnorm(ctx, x, "model.norm", keep_input=keep_input)
    with g.module("lm_head"):
        _compiled_loss(ctx, g.new("out", (B, S, V), ("B", "S", "V"), a))


def _compiled_loss(ctx: Ctx, logits: Sym) -> None:
    """What a compiled ``ForCausalLMLoss`` keeps: the logits in their own dtype (not the fp32
    ``log_softmax`` output), the row max and log-sum-exp, the labels padded to S+1, the count."""
    g = ctx.graph
    B, S = ctx.B, ctx.S
    with g.module("loss"):  # kept by the loss: a pipeline's last stage keeps it (estimate/parallel_pp.py _stage_of)
        g.save(logits)
        kept = (g.new("row_max", (B * S, 1), ("B·S", "1"), "float32", False),
                g.new("logsumexp", (B * S, 1), ("B·S", "1"), "float32", False),
                g.new("labels_padded", (B, S + 1), ("B", "S+1"), "int64", False))
        loss_value(g, "float32")  # the fp32 loss the compiled graph returns (estimate/loss_value.py)
        g.save(*kept, g.new("total_weight", (), (), "float32", False))


def _checkpointed_layers(ctx: Ctx, x: Sym) -> None:
    """``--recompute full`` (transformers' non-reentrant checkpoint of each decoder layer) inside
    the compiled region. Dynamo turns each checkpoint into a ``tag_activation_checkpoint`` region
    whose nodes the partitioner must recompute (``torch/_functorch/partitioners.py``
    ``must_recompute``); what crosses into backward is each block's input, the causal mask the
    blocks read (materialized under compile: B·1·S·S in the activation dtype, one tensor for all
    blocks) and, for each block, the generator state its recomputed SDPA replays (the CPU kernel
    is tagged ``nondeterministic_seeded``: ``functionalize_rng_ops`` saves
    ``torch.get_rng_state()``, 5056 bytes of host memory no allocator sees, not counted here;
    ``torch.cuda.get_rng_state()`` is a host tensor too).
    The last block's output, the final norm's input, is recomputed with that block."""
    g, m = ctx.graph, ctx.model
    B, S, H, a = ctx.B, ctx.S, m.hidden_size, ctx.param
    with g.module("model"):
        g.save(g.new("causal_mask", (B, 1, S, S), ("B", "1", "S", "S"), a, False))
    checkpointed_moe_arange(ctx)

    def layer(_i: int, x: Sym) -> Sym:
        g.save(x)
        return g.new("residual_mlp", (B, S, H), ("B", "S", "H"), a)

    _layers(ctx, "model.layers.", x, layer)


def _rmsnorm(ctx: Ctx, x: Sym, name: str, *, keep_input: bool = True, keep_output: bool = True) -> Sym:
    """Keeps fp32 ``rsqrt``, its output (the following linear's input, unless Float8 linears
    recompute it) and its input, unless that is a residual sum, recomputed from the block input and
    ``o_proj``'s output."""
    g = ctx.graph
    g.save(x, when=keep_input)
    with g.module(name):
        g.save(g.new("rsqrt", x.shape[:-1] + (1,), x.dims[:-1] + ("1",), "float32", False))
        out = g.new("out", x.shape, x.dims, ctx.low or x.dtype)  # under autocast: the linears' 16-bit input
        # SP: the all-gathered output instead, a collective's output the partitioner must save (compiled_tp.py)
        g.save(ctx.sp_gather(out, "out_gathered"), when=keep_output)
    return out

