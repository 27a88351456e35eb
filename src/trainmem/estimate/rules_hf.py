"""The ``hf`` profile: what Hugging Face transformers' modules keep for backward.

Modelled on transformers 5.x source (``modeling_llama.py``, ``modeling_gpt2.py``,
``modeling_mixtral.py``, ``integrations/sdpa_attention.py``, ``loss/loss_utils.py``) and
checked against saved-tensor hooks on real models in ``tests/estimate/test_groundtruth.py``.
Names are the real module paths, so estimates join with traces. This module holds the model-level
forwards (Llama, GPT-2/NeoX, BERT) and the registry of families' own forwards; the shared block
pieces are in ``rules_hf_parts``, the checkpointed blocks' masks in ``rules_hf_masks``, the
mixture-of-experts block in ``rules_hf_moe``.
"""

from __future__ import annotations

from contextlib import nullcontext
from functools import partial
from importlib import import_module

from trainmem.errors import UnsupportedError
from trainmem.estimate.attention import attention_core, resolve_kernel, window_mask
from trainmem.estimate.ctx import Ctx
from trainmem.estimate.graph import Sym
from trainmem.estimate.heads import task_head
from trainmem.estimate.rules_hf_masks import _checkpoint_extras, _eager_window_masks
from trainmem.estimate.rules_hf_moe import _moe, load_balancing_items
from trainmem.estimate.rules_hf_parts import (_activation, _embedding, _gated_mlp, _head, _heads, _layernorm, _layers,
                                              _loss, _policy, _qkv_proj, _rmsnorm, _rope, _rules, token_ids)
from trainmem.estimate.rules_prenorm import prenorm_block
from trainmem.families import family_attentions
from trainmem.names import embedding_indices, embedding_output

__all__ = ["hf_forward"]


def hf_forward(ctx: Ctx) -> None:
    """The model forward the family's :class:`~trainmem.families.BlockRules` name (``trainmem/families/``)."""
    if _rules(ctx).forward == "traced":  # no hand-written rules: the traced profile covers it
        m = ctx.model
        kinds = ", ".join(dict.fromkeys(k.label for k in m.kinds))
        raise UnsupportedError(f"{m.name}: the hf profile has no hand-written rules for {m.family} blocks "
                               f"({kinds}); estimate it with --profile traced")
    if ctx.impl.framework != "hf" and (_rules(ctx).forward in _FORWARDS or ctx.model.arch == "encoder" or (
            _rules(ctx).forward == "gpt" and not _rules(ctx).neox)):  # estimate/rules_litgpt_variants.py
        raise UnsupportedError(f"{ctx.model.name}: --framework litgpt models LitGPT's LLaMA blocks, not {ctx.model.family}")
    _refuse_sdpa(ctx)
    if _rules(ctx).forward in _FORWARDS:  # a family's own module (a registry, imported on use)
        module, fn = _FORWARDS[_rules(ctx).forward]
        getattr(import_module(f"trainmem.estimate.{module}"), fn)(ctx)
    elif ctx.model.arch == "encoder":
        _bert(ctx)
    elif _rules(ctx).forward == "gpt":
        _gpt(ctx)
    else:
        _llama(ctx)


#: the kernels transformers runs only through attn_implementation="sdpa" (``models/hf.py`` ``HF_ATTENTION``;
#: ``flash`` is FlashAttention-2 on CUDA too, which Gemma-2 supports)
_SDPA_ONLY = ("sdpa", "sdpa-math", "mem-efficient")


def _refuse_sdpa(ctx: Ctx) -> None:
    """A family whose kernels (``Family.attentions``) lack sdpa has ``_supports_sdpa = False`` (Gemma-2's
    soft-capping, gpt-oss's sinks): transformers 5.x refuses to build it with SDPA, it does not fall back
    (``modeling_utils.PreTrainedModel._sdpa_can_dispatch`` raises ValueError; eager only when none is asked
    for), so neither does the estimate: no SDPA estimate that drops the soft-cap."""
    m = ctx.model
    runs = family_attentions(m.family)
    if ctx.impl.attention in _SDPA_ONLY and "sdpa" not in runs:
        raise UnsupportedError(f"{m.name}: {m.family}: transformers gives it no {ctx.impl.attention} attention "
                               f"(_supports_sdpa = False: it refuses to build it with SDPA); estimate it with "
                               f"--attention {runs[0]} (as --profile traced and trainmem trace run it)")


#: BlockRules.forward -> (module under trainmem.estimate, function): families whose rules live apart
_FORWARDS = {"gpt_oss": ("rules_gpt_oss", "gpt_oss_forward"), "mla": ("rules_mla", "mla_forward"),
             "llama4": ("rules_llama4", "llama4_forward"), "gpt_bigcode": ("rules_gpt_bigcode", "gpt_bigcode_forward")}


# --- Llama family --------------------------------------------------------------------------

def _llama(ctx: Ctx) -> None:
    g, m, rules = ctx.graph, ctx.model, _rules(ctx)
    gemma = rules.unit_offset_norm
    x = _embedding(ctx, "model.embed_tokens")
    if rules.scaled_embedding:  # the scaled embedding multiplies by sqrt(H): a new tensor, keeps only the scalar
        # (GemmaTextScaledWordEmbedding.forward: `* self.embed_scale.to(self.weight.dtype)`); the scalar autograd
        # saves is the registered 0-d buffer itself, counted once as the buffer item (estimate/buffers.py), as
        # `trainmem trace` files it (trace/model_states.py register_states): no activation here
        x = g.new("model.embed_tokens.scaled", x.shape, x.dims, x.dtype, x.requires_grad)
    with g.module("model.embed_tokens"):  # vocab-parallel embedding reduce-scatters into SP
        x = ctx.sp_scatter(x, "out_sp")
    tables = {}  # one cos/sin pair, or one per attention type (Gemma3RotaryEmbedding.forward(layer_type))
    with g.module("model.rotary_emb"):
        rot = (1, ctx.S, m.head_dim)
        for att in sorted({k.attention for k in m.kinds}) if rules.rope_per_layer_type else ("",):
            suffix = f"_{att}" if att else ""
            dt = "float32" if rules.rope_fp32 else x.dtype
            tables[att] = (g.new(f"cos{suffix}", rot, ("1", "S", "hd"), dt, False),
                           g.new(f"sin{suffix}", rot, ("1", "S", "hd"), dt, False))
    kernel = resolve_kernel(ctx)
    held = _checkpoint_extras(ctx, kernel, x.dtype)
    if ctx.impl.recompute not in ("none", "selective") and kernel != "eager" and any(
            window_mask(ctx, k) for k in set(m.kinds)):
        # checkpointed blocks hold the model's boolean sliding-window mask (one, expanded over B:
        # masking_utils.sdpa_mask builds it from (1, 1, S, S) index arithmetic)
        held.append(g.new("model.sliding_window_mask", (1, 1, ctx.S, ctx.S), ("1", "1", "S", "S"), "bool", False))
    local = _eager_window_masks(ctx, kernel, held, x.dtype)
    def layer(i: int, x: Sym) -> Sym:
        masked = kernel != "eager" and window_mask(ctx, m.kind(i))  # eager adds its mask: nothing kept
        mine = local if m.kind(i).attention == "sliding" else held
        k_i = resolve_kernel(ctx, masked) if masked else kernel
        cos, sin = tables[m.kind(i).attention if rules.rope_per_layer_type else ""]
        moe = m.kind(i).mlp == "moe"  # Qwen3-MoE's mlp_only_layers / decoder_sparse_step: dense blocks
        if ctx.impl.checkpointed(i):
            with g.checkpoint(x, cos, sin, *mine, policy=_policy(ctx)):
                return _llama_layer(ctx, x, cos, sin, k_i, masked=masked, moe=moe)
        return _llama_layer(ctx, x, cos, sin, k_i, mine, masked=masked, moe=moe)

    x = _layers(ctx, "model.layers.", x, layer)
    if ctx.impl.framework != "hf":  # LitGPT's ln_f (estimate/rules_litgpt.py)
        from trainmem.estimate.rules_litgpt import litgpt_rmsnorm
        h = litgpt_rmsnorm(ctx, x, "model.norm")
    else:
        h = _rmsnorm(ctx, x, "model.norm", gemma=gemma)
    if m.head != "lm":
        return task_head(ctx, h)
    with g.module("lm_head"):
        h = ctx.sp_gather(h, "input_gathered")
    logits = _head(ctx, h, "lm_head")
    _loss(ctx, logits)
    if m.router_aux_loss:  # after the cross-entropy (estimate/rules_hf_moe.py)
        load_balancing_items(ctx)


def _llama_layer(ctx: Ctx, x: Sym, cos: Sym, sin: Sym, kernel: str, held: list[Sym] = (), *,
                 masked: bool = False, moe: bool = False) -> Sym:
    if ctx.impl.framework != "hf":  # LitGPT's Block (estimate/rules_litgpt_variants.py)
        from trainmem.estimate.rules_litgpt_variants import litgpt_layer
        return litgpt_layer(ctx, x, cos, sin, kernel, held, masked=masked, moe=moe)
    rules = _rules(ctx)
    rmsnorm = partial(_rmsnorm, ctx, gemma=rules.unit_offset_norm)
    post = rules.post_norms  # OLMo-2: no norm before attention or the MLP, one after each
    return prenorm_block(ctx, x, (lambda t, _name: t) if post else rmsnorm,
                         lambda h: _llama_attention(ctx, h, cos, sin, kernel, held, masked),
                         partial(_llama_mlp, ctx, moe),
                         mlp_norm="pre_feedforward_layernorm" if rules.sandwich_norms else "post_attention_layernorm",
                         out_norm=rmsnorm if rules.sandwich_norms or post else None)


def _llama_mlp(ctx: Ctx, moe: bool, h: Sym) -> Sym:
    """The gated MLP or the MoE block, gathered from and scattered back to SP shards."""
    h = ctx.sp_gather(h, "input_gathered")
    return ctx.sp_scatter(_moe(ctx, h) if moe else _gated_mlp(ctx, h), "out_sp")


def _llama_attention(ctx: Ctx, h: Sym, cos: Sym, sin: Sym, kernel: str, held: list[Sym], masked: bool) -> Sym:
    """``LlamaAttention.forward`` and the variants the family's rules name (fused qkv, q/k norms)."""
    g, m, rules = ctx.graph, ctx.model, _rules(ctx)
    gemma, post = rules.unit_offset_norm, rules.post_norms
    H, qs, kvs = m.hidden_size, m.q_size, m.kv_size
    h = ctx.sp_gather(h, "input_gathered")
    if rules.fused_qkv:
        with g.module("qkv_proj"):
            qkv = ctx.linear(h, qs + 2 * kvs, "(A+2·Akv)·hd", weight=(qs + 2 * kvs, H), bias=m.qkv_bias)
        q = g.new("q", (ctx.B, ctx.S, qs), ("B", "S", "A·hd"), qkv.dtype, qkv.requires_grad)
        k = g.new("k", (ctx.B, ctx.S, kvs), ("B", "S", "Akv·hd"), qkv.dtype, qkv.requires_grad)
        v = qkv  # a view of the fused output
    else:
        q, k, v = _qkv_proj(ctx, h)
    if m.qk_norm and post:  # Olmo2Attention: q_norm/k_norm over the whole projection
        q, k = _rmsnorm(ctx, q, "q_norm"), _rmsnorm(ctx, k, "k_norm")
    elif m.qk_norm:
        q = _rmsnorm(ctx, _heads(q, m.num_heads, "A", m.head_dim), "q_norm", gemma=gemma)
        k = _rmsnorm(ctx, _heads(k, m.num_kv_heads, "Akv", m.head_dim), "k_norm", gemma=gemma)
    q = _rope(ctx, q, cos, sin, "q_rope", cast_back=rules.rope_fp32)
    k = _rope(ctx, k, cos, sin, "k_rope", cast_back=rules.rope_fp32)
    # the KV cache's torch.cat hands attention fresh copies of K and V (K's size either way: the rotated key)
    k = g.new("k_cache", k.shape, k.dims, k.dtype, k.requires_grad)
    if ctx.kv_cache or not rules.fused_qkv:
        v = g.new("v_cache", (ctx.B, ctx.S, kvs), ("B", "S", "Akv·hd"), v.dtype, v.requires_grad)
    # without the cache (checkpointing sets use_cache=False) a fused projection's V reaches attention as a view of
    # its output (Phi3Attention.forward, modeling_phi3.py: ``qkv[..., query_pos + num_key_value_heads * head_dim:]``), so the
    # kernel's saved V keeps the whole (B, S, (A+2·Akv)·hd) storage
    gqa_native = kernel != "eager"  # transformers' use_gqa_in_sdpa: no mask, head_dim <= 256
    with g.checkpoint(q, k, v, *held) if ctx.impl.recompute == "selective" else nullcontext():
        o = attention_core(ctx, q, k, v, kernel=kernel, gqa_native=gqa_native and m.head_dim <= 256,
                           softcap=m.attn_softcap, out_copy=rules.fused_qkv, masked=masked)
    with g.module("o_proj"):
        return ctx.sp_scatter(ctx.linear(o, H, "H", weight=(H, qs), bias=m.out_bias), "out_sp")


# --- GPT-2 / GPT-NeoX ------------------------------------------------------------------------

def _gpt(ctx: Ctx, block=None, positions_to_blocks: bool = True) -> None:
    """GPT-2's / GPT-NeoX's model forward; ``block``: another family's block (``rules_gpt_bigcode``), and
    ``positions_to_blocks=False`` where the model hands its blocks no position ids (a checkpoint holds none)."""
    g, m = ctx.graph, ctx.model
    block = block or _gpt_layer
    neox = _rules(ctx).neox
    root = "gpt_neox" if neox else "transformer"
    x = _embedding(ctx, f"{root}.embed_in" if neox else f"{root}.wte")
    positions = None
    if m.max_positions:
        pos = _embedding(ctx, f"{root}.wpe", positions=True)
        # a frozen wpe keeps no indices: checkpointed blocks then hold their own position ids
        positions = next((t for t in ctx.graph.saved.values() if t.name == embedding_indices(root)), None)
        x = ctx.add(x, pos, f"{root}.embed_sum")
    x = ctx.dropout(x, m.embd_dropout, f"{root}.drop", module=True)
    kernel = resolve_kernel(ctx)
    cos = sin = None
    if neox:
        rot = m.rotary_dim or m.head_dim
        with g.module(f"{root}.rotary_emb"):
            cos = g.new("cos", (1, ctx.S, rot), ("1", "S", "rot"), x.dtype, False)
            sin = g.new("sin", (1, ctx.S, rot), ("1", "S", "rot"), x.dtype, False)
    layers = "layers" if neox else "h"
    held = [t for t in _checkpoint_extras(ctx, kernel, x.dtype, positions, root)
            if positions_to_blocks or t.dtype != "int64"]
    # selective checkpoints the attention function, which gets the position ids too: GPT2Block.forward and
    # GPTNeoXLayer.forward pass position_ids=... to their attention, whose forward has no such parameter, so
    # they reach attention_interface in **kwargs (modeling_gpt2.py, modeling_gpt_neox.py), as in Llama's
    # (rules_hf_masks._checkpoint_extras); other non-checkpointed blocks hold no ids
    core = held if ctx.impl.recompute == "selective" else [t for t in held if t.dtype != "int64"]
    def layer(i: int, x: Sym) -> Sym:
        if ctx.impl.checkpointed(i):
            with g.checkpoint(*[t for t in (x, cos, sin, *held) if t is not None], policy=_policy(ctx)):
                return block(ctx, x, kernel, cos, sin)
        return block(ctx, x, kernel, cos, sin, core)

    x = _layers(ctx, f"{root}.{layers}.", x, layer)
    h = _layernorm(ctx, x, f"{root}.final_layer_norm" if neox else f"{root}.ln_f")
    if m.head != "lm":
        return task_head(ctx, h)
    logits = _head(ctx, h, "lm_head")
    _loss(ctx, logits)


def _gpt_layer(ctx: Ctx, x: Sym, kernel: str, cos, sin, held: list[Sym] = ()) -> Sym:
    if ctx.impl.framework != "hf":  # LitGPT's Block for GPT-NeoX (estimate/rules_litgpt_variants.py)
        from trainmem.estimate.rules_litgpt_variants import litgpt_layer
        return litgpt_layer(ctx, x, cos, sin, kernel, held)
    g, m = ctx.graph, ctx.model
    H, F = m.hidden_size, m.ffn_size
    neox = _rules(ctx).neox
    B, S, A, hd = ctx.B, ctx.S, m.num_heads, m.head_dim
    h = _layernorm(ctx, x, "input_layernorm" if neox else "ln_1")
    with g.module("attention" if neox else "attn"):
        with g.module("query_key_value" if neox else "c_attn"):
            qkv = ctx.linear(h, 3 * H, "3H", weight=(3 * H, H), bias=m.qkv_bias)
        heads = ((B, A, S, hd), ("B", "A", "S", "hd"))
        if neox:
            q = _rope(ctx, g.new("q", *heads, qkv.dtype, qkv.requires_grad), cos, sin, "q_rope")
            k = _rope(ctx, g.new("k", *heads, qkv.dtype, qkv.requires_grad), cos, sin, "k_rope")
        else:
            q = k = qkv  # strided views of the c_attn output (SDPA keeps q as such; eager copies it)
        v = qkv
        if ctx.kv_cache or (neox and kernel in ("eager", "math")):
            # attention reads K/V from the DynamicCache's cat copies (without a cache, under checkpointing,
            # GPT-2 reads the c_attn views: attention_core ``fused``, the eager and math paths and the fused
            # SDPA kernel alike (on CPU a recomputed block holds no copy: tests/estimate/test_fsdp_peak_middle.py);
            # GPT-NeoX's SDPA reads the rotated k and v, a view of the query_key_value output, kept whole;
            # GPT-NeoX's eager path is not checked without it)
            k = g.new("k_cache", *heads, k.dtype, k.requires_grad)
            v = g.new("v_cache", *heads, qkv.dtype, qkv.requires_grad)
        with g.checkpoint(q, k, v, *held) if ctx.impl.recompute == "selective" else nullcontext():
            o = attention_core(ctx, q, k, v, kernel=kernel, gqa_native=True, softmax_fp32=neox, out_copy=neox,
                               q_copy=not neox and kernel in ("eager", "math"), fused=None if neox else qkv)
        with g.module("dense" if neox else "c_proj"):
            a = ctx.linear(o, H, "H", weight=(H, H), bias=m.out_bias)
        a = ctx.dropout(a, m.hidden_dropout, "resid_dropout", module=True)
    if neox and m.parallel_residual:
        h2 = _layernorm(ctx, x, "post_attention_layernorm")
    else:
        x = ctx.add(x, a, "residual_attn")
        h2 = _layernorm(ctx, x, "post_attention_layernorm" if neox else "ln_2")
    with g.module("mlp"):
        with g.module("dense_h_to_4h" if neox else "c_fc"):
            u = ctx.linear(h2, F, "F", weight=(F, H), bias=m.mlp_bias)
        with g.module("act"):
            act = _activation(ctx, u, "gelu_new" if m.activation == "gelu_tanh" and not neox else "act")
        with g.module("dense_4h_to_h" if neox else "c_proj"):
            y = ctx.linear(act, H, "H", weight=(H, F), bias=m.mlp_bias)
        y = ctx.dropout(y, m.hidden_dropout, "dropout", module=True)
    if neox and m.parallel_residual:
        return ctx.add(ctx.add(x, a, "residual_attn"), y, "residual_mlp")
    return ctx.add(x, y, "residual_mlp")


# --- BERT ----------------------------------------------------------------------------------

def _bert(ctx: Ctx) -> None:
    g, m = ctx.graph, ctx.model
    H = m.hidden_size
    tokens = token_ids(ctx, "bert.embeddings.word_embeddings")  # the MLM loss keeps them too (_loss: labels)
    x = _embedding(ctx, "bert.embeddings.word_embeddings", ids=tokens)
    # position ids are a slice of a registered buffer (no allocation); token-type ids are
    # gathered from one (1, S) buffer row and expanded, so they cost S·8 bytes
    pos = _embedding(ctx, "bert.embeddings.position_embeddings", positions=True)
    # (a frozen position embedding keeps no indices: nothing to drop; _embedding names them the parent's)
    ids = embedding_indices("bert.embeddings")
    g.saved.pop(next((k for k, t in g.saved.items() if t.name == ids), None), None)
    x = ctx.add(x, pos, "bert.embeddings.sum")
    if m.type_vocab_size:
        # embedding backward keeps the ids only for the weight's gradient (frozen under LoRA)
        wt = ctx.trainable("bert.embeddings.token_type_embeddings.weight")
        with g.module("bert.embeddings"):
            g.save(g.new("token_type_ids", (1, ctx.S), ("1", "S"), "int64", False), when=wt)
        tt = g.new(embedding_output("bert.embeddings.token_type_embeddings"), x.shape, x.dims, ctx.param, wt)
        x = ctx.add(x, tt, "bert.embeddings.sum_tt")
    x = _layernorm(ctx, x, "bert.embeddings.LayerNorm")
    x = ctx.dropout(x, m.embd_dropout, "bert.embeddings.dropout", module=True)
    kernel = resolve_kernel(ctx)
    def layer(i: int, x: Sym) -> Sym:
        with g.checkpoint(x, policy=_policy(ctx)) if ctx.impl.checkpointed(i) else nullcontext():
            return _bert_layer(ctx, x, kernel)

    x = _layers(ctx, "bert.encoder.layer.", x, layer)
    if m.head != "mlm":
        return task_head(ctx, x)
    with g.module("cls.predictions.transform"):
        with g.module("dense"):
            t = ctx.linear(x, H, "H", weight=(H, H))
        with g.module("transform_act_fn"):
            t = _activation(ctx, t, "gelu")
        t = _layernorm(ctx, t, "LayerNorm")
    with g.module("cls.predictions.decoder"):
        logits = ctx.linear(t, m.vocab_size, "V", weight=(m.vocab_size, H))
    _loss(ctx, logits, upcast=False, labels=tokens)  # labels.view(-1): the caller's labels


def _bert_layer(ctx: Ctx, x: Sym, kernel: str) -> Sym:
    g, m = ctx.graph, ctx.model
    H, F = m.hidden_size, m.ffn_size
    with g.module("attention"):
        with g.module("self"):
            qkv = []
            for n in ("query", "key", "value"):
                with g.module(n):
                    qkv.append(ctx.linear(x, H, "H", weight=(H, H), bias=m.qkv_bias))
            q, k, v = qkv  # views of the three projections' outputs
            with g.checkpoint(q, k, v) if ctx.impl.recompute == "selective" else nullcontext():
                o = attention_core(ctx, q, k, v, kernel=kernel, gqa_native=True, softmax_fp32=False,
                                   q_copy=kernel in ("eager", "math"))
        with g.module("output"):
            with g.module("dense"):
                a = ctx.linear(o, H, "H", weight=(H, H), bias=m.out_bias)
            a = ctx.dropout(a, m.hidden_dropout, "dropout", module=True)
            x = _layernorm(ctx, ctx.add(a, x, "residual"), "LayerNorm")
    with g.module("intermediate"):
        with g.module("dense"):
            u = ctx.linear(x, F, "F", weight=(F, H), bias=m.mlp_bias)
        with g.module("intermediate_act_fn"):
            u = _activation(ctx, u, "gelu")
    with g.module("output"):
        with g.module("dense"):
            y = ctx.linear(u, H, "H", weight=(H, F), bias=m.mlp_bias)
        y = ctx.dropout(y, m.hidden_dropout, "dropout", module=True)
        return _layernorm(ctx, ctx.add(y, x, "residual"), "LayerNorm")
