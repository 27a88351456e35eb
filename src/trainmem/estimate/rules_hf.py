"""The ``hf`` profile: what Hugging Face transformers' modules keep for backward.

Modelled on transformers 5.x source (``modeling_llama.py``, ``modeling_gpt2.py``,
``modeling_mixtral.py``, ``integrations/sdpa_attention.py``, ``loss/loss_utils.py``) and
checked against saved-tensor hooks on real models in ``tests/estimate/test_groundtruth.py``.
Names are the real module paths, so estimates join with traces.
"""

from __future__ import annotations

from contextlib import nullcontext
from importlib import import_module

from trainmem.errors import UnsupportedError
from trainmem.estimate.attention import attention_core, resolve_kernel, window_mask
from trainmem.estimate.ctx import Ctx, promote
from trainmem.estimate.losses import FRAMEWORK_LOSSES, framework_loss_items, torchtune_head
from trainmem.estimate.graph import OpPolicy, Sym
from trainmem.estimate.heads import task_head
from trainmem.families import BlockRules, family_of, token_embedding_modules
from trainmem.names import EMBEDDING_INDICES, EMBEDDING_OUTPUT, embedding_indices, embedding_output

__all__ = ["hf_forward"]


def hf_forward(ctx: Ctx) -> None:
    """The model forward the family's :class:`~trainmem.families.BlockRules` name (``trainmem/families/``)."""
    if _rules(ctx).forward == "traced":  # no hand-written rules: the traced profile covers it
        m = ctx.model
        kinds = ", ".join(dict.fromkeys(k.label for k in m.kinds))
        raise UnsupportedError(f"{m.name}: the hf profile has no hand-written rules for {m.family} blocks "
                               f"({kinds}); estimate it with --profile traced")
    if _rules(ctx).forward in _FORWARDS:  # a family's own module (a registry, imported on use)
        module, fn = _FORWARDS[_rules(ctx).forward]
        getattr(import_module(f"trainmem.estimate.{module}"), fn)(ctx)
    elif ctx.model.arch == "encoder":
        _bert(ctx)
    elif _rules(ctx).forward == "gpt":
        _gpt(ctx)
    else:
        _llama(ctx)


#: BlockRules.forward -> (module under trainmem.estimate, function): families whose rules live apart
_FORWARDS = {"gpt_oss": ("rules_gpt_oss", "gpt_oss_forward"), "mla": ("rules_mla", "mla_forward"),
             "llama4": ("rules_llama4", "llama4_forward")}


def _rules(ctx: Ctx) -> BlockRules:
    return family_of(ctx.model).rules


def _layers(ctx: Ctx, prefix: str, x: Sym, layer) -> Sym:
    """Run the blocks ``{prefix}0``, ``{prefix}1``, ... keeping ONE template per layer kind
    (``ModelSpec.kinds``): a kind's second block (which, unlike block 0, reads another block's
    output, and which finds the tensors shared by the blocks of its kind, such as its rotary
    table, already kept by the first) is the template; later blocks of that kind (same recompute)
    repeat it instead of being simulated again."""
    g, m = ctx.graph, ctx.model
    n = m.num_layers
    replicate = ctx.replicate and ctx.impl.recompute != "every-k" and n > 3
    templates: dict = {}  # kind -> (source block, kept tensors, its output)
    copies: dict = {}  # kind -> blocks that repeat its template
    seen: set = set()
    for i in range(n):
        kind = m.kind(i)
        if replicate and kind in templates:
            src, _, out = templates[kind]
            copies.setdefault(kind, []).append(i)
            x = Sym(out.name.replace(f"{prefix}{src}.", f"{prefix}{i}.", 1), out.shape, out.dims, out.dtype,
                    out.requires_grad)
            continue
        mark = g.mark()
        with g.module(f"{prefix}{i}"):
            x = layer(i, x)
        if kind in seen:
            templates[kind] = (i, g.since(mark), x)
        seen.add(kind)
    for kind, dsts in copies.items():
        src, template, _ = templates[kind]
        g.repeat(template, prefix, src, dsts)
    return x


# --- shared pieces -------------------------------------------------------------------------

def _embedding(ctx: Ctx, name: str, *, positions: bool = False) -> Sym:
    """``nn.Embedding``: keeps the indices; the output is a new tensor in the weight's dtype.
    ``positions``: a position embedding, indexed by (1, S) position ids."""
    g = ctx.graph
    shape, dims = ((1, ctx.S), ("1", "S")) if positions else ((ctx.B, ctx.S), ("B", "S"))
    ids = None
    if positions:  # made by the embedding's parent (GPT2Model.forward, modeling_gpt2.py: torch.arange(S)
        # + past_seen_tokens): named in its scope, ``transformer.indices``, where a measured step sees them made
        with g.module(name.rpartition(".")[0]):
            ids = g.new(EMBEDDING_INDICES, shape, dims, "int64", False)
    with g.module(name):
        wt = ctx.weight_trainable()
        if ids is None:  # token ids: the model's input, not made by an op
            ids = g.new(EMBEDDING_INDICES, shape, dims, "int64", False, input=True)
        g.save(ids, when=wt)  # only the weight's gradient needs them
        out = g.new(EMBEDDING_OUTPUT, shape + (ctx.model.hidden_size,), dims + ("H",), ctx.param, wt)
        if not wt and ctx.impl.recompute in ("full", "every-k") and name in token_embedding_modules():
            # fine-tuning: HF's gradient_checkpointing_enable() calls enable_input_require_grads(),
            # so a frozen token embedding's output becomes a leaf that requires grad (the graph holds it)
            out.requires_grad = True
            g.save(out)
        return out


def _rmsnorm(ctx: Ctx, x: Sym, name: str, *, gemma: bool = False, cast_last: bool = False) -> Sym:
    """HF ``LlamaRMSNorm``: ``w * (x.float() * rsqrt(mean(x²)+eps)).to(dtype)``.

    Keeps the fp32 input (pow and mul), rsqrt (mul), and the normalized tensor (mul by w).
    Gemma's variant multiplies by ``1 + w`` in fp32 and casts last.
    """
    g = ctx.graph
    with g.module(name):
        wt = ctx.weight_trainable()
        x32 = ctx.cast(x, "float32", "x_fp32")
        rs = g.new("rsqrt", x.shape[:-1] + (1,), x.dims[:-1] + ("1",), "float32", x.requires_grad)
        normed = g.new("normed", x.shape, x.dims, "float32", x.requires_grad)
        g.save(x32, rs, when=x.requires_grad)
        if gemma:  # normed * (1 + w.float()): keeps normed for w's grad and (1 + w) for x's
            g.save(normed, when=wt)
            g.save(g.new("one_plus_w", x.shape[-1:], x.dims[-1:], "float32", wt), when=x.requires_grad)
            return ctx.cast(g.new("out_fp32", x.shape, x.dims, "float32", x.requires_grad or wt), x.dtype, "out")
        if cast_last or _rules(ctx).post_norms:  # Olmo2RMSNorm, GptOssRMSNorm: (w * normed).to(dtype): keeps
            # normed in fp32, casts last
            g.save(normed, when=wt)
            return ctx.cast(g.new("out_fp32", x.shape, x.dims, "float32", x.requires_grad or wt), x.dtype, "out")
        nc = ctx.cast(normed, x.dtype, "normed_cast")
        g.save(nc, when=wt)
        return g.new("out", x.shape, x.dims, promote(ctx.param, x.dtype), x.requires_grad or wt)


def _layernorm(ctx: Ctx, x: Sym, name: str) -> Sym:
    """``native_layer_norm``: keeps input, mean and rstd (fp32). CUDA autocast runs it in fp32."""
    g = ctx.graph
    with g.module(name):
        if ctx.low and ctx.impl.device == "cuda":
            x = ctx.cast(x, "float32", "x_fp32")
        stat_shape, stat_dims = x.shape[:-1] + (1,), x.dims[:-1] + ("1",)
        # CUDA keeps fp32 statistics; the CPU kernel keeps them in the input's dtype
        stat = "float32" if ctx.impl.device == "cuda" else x.dtype
        rg = x.requires_grad or ctx.weight_trainable()
        # aten/src/ATen/native/layer_norm.cpp layer_norm_cpu allocates the output, then mean and rstd
        out = g.new("out", x.shape, x.dims, x.dtype, rg)
        g.save(x, g.new("mean", stat_shape, stat_dims, stat, False), g.new("rstd", stat_shape, stat_dims, stat, False),
               when=rg)
        return out


def _rope(ctx: Ctx, x: Sym, cos: Sym, sin: Sym, label: str, *, cast_back: bool = False) -> Sym:
    """``x*cos + rotate_half(x)*sin``: keeps cos and sin (x needs grad, they do not).
    ``cast_back``: OLMo-2 rotates in the table's fp32 and casts to x's dtype (``apply_rotary_pos_emb``)."""
    ctx.graph.save(cos, sin, when=x.requires_grad)
    out = ctx.graph.new(label, x.shape, x.dims, promote(x.dtype, cos.dtype), x.requires_grad)
    return ctx.cast(out, x.dtype, f"{label}_cast") if cast_back else out


def _activation(ctx: Ctx, x: Sym, kind: str) -> Sym:
    """One activation kernel. ``gelu_new`` is HF's python tanh-GELU: five saved tensors."""
    g = ctx.graph
    if kind == "gelu_new":
        hi = x
        if ctx.low and ctx.impl.device == "cuda":  # pow is on CUDA autocast's fp32 list
            hi = ctx.cast(x, "float32", "x_fp32")
        t = g.new("tanh", x.shape, x.dims, hi.dtype)
        one_plus = g.new("one_plus_tanh", x.shape, x.dims, hi.dtype)
        half_x = g.new("half_x", x.shape, x.dims, x.dtype)
        g.save(x, hi, t, one_plus, half_x, when=x.requires_grad)
        return g.new("out", x.shape, x.dims, promote(half_x.dtype, one_plus.dtype), x.requires_grad)
    g.save(x, when=x.requires_grad)  # silu, gelu, gelu(tanh), relu keep their input (relu its output: same size)
    return g.new("out", x.shape, x.dims, x.dtype, x.requires_grad)


def _loss(ctx: Ctx, logits: Sym, *, upcast: bool = True) -> None:
    """HF ``ForCausalLMLoss``: ``logits.float()``, log_softmax keeps its output, nll_loss keeps
    the shifted targets and the total weight."""
    g = ctx.graph
    B, S, V = ctx.B, ctx.S, ctx.model.vocab_size
    with g.module("loss"):
        if ctx.step.loss in FRAMEWORK_LOSSES:  # torchtune's / LitGPT's chunked CE (estimate/losses.py)
            return framework_loss_items(ctx, logits)
        # ForCausalLMLoss pads and shifts the labels before cross_entropy: the targets come first
        target = g.new("target", *_target_shape(B, S), "int64", False)
        if ctx.step.loss == "ce":
            # HF causal LMs upcast; autocast runs cross_entropy in fp32 anyway
            dtype = "float32" if upcast or ctx.low else logits.dtype
            g.save(g.new("log_softmax", (B * S, V), ("B·S", "V"), dtype), when=logits.requires_grad)
        elif ctx.step.loss == "fused-ce":
            # fused linear+CE computes d(hidden) in forward and keeps it for backward
            g.save(g.new("grad_hidden", (B, S, ctx.model.hidden_size), ("B", "S", "H"), logits.dtype))
        g.save(target, g.new("total_weight", (), (), "float32", False), when=logits.requires_grad)


def _target_shape(B: int, S: int) -> tuple[tuple[int, ...], tuple[str, ...]]:
    """The storage of the targets nll_loss keeps. ForCausalLMLoss (transformers/loss/loss_utils.py)
    pads the labels to (B, S+1) and takes ``labels[..., 1:].contiguous()``: at B=1 that slice is
    already contiguous (a size-1 dim's stride does not count), so the padded (1, S+1) storage is
    kept; from B=2 on ``contiguous()`` copies it into B·S."""
    return ((S + 1,), ("S+1",)) if B == 1 else ((B * S,), ("B·S",))


def _head(ctx: Ctx, h: Sym, name: str) -> Sym:
    m = ctx.model
    if ctx.step.loss in ("chunked-ce", "fused-ce"):
        ctx.graph.save(h)  # chunked/fused CE recompute logits from the hidden state
        return ctx.graph.new("logits_chunk", h.shape, h.dims, h.dtype, h.requires_grad or ctx.trainable(f"{name}.weight"))
    if ctx.step.loss == "torchtune-chunked-ce" and not ctx.impl.compile:  # one head matmul per chunk
        return torchtune_head(ctx, h, name)
    with ctx.graph.module(name):
        logits = ctx.linear(h, m.vocab_size, "V", weight=(m.vocab_size, m.hidden_size))
    if m.logit_softcap:  # Gemma-2: cap * tanh(logits / cap); tanh keeps its output
        with ctx.graph.module("loss"):
            t = ctx.graph.new("logit_softcap_tanh", logits.shape, logits.dims, logits.dtype, logits.requires_grad)
            ctx.graph.save(t, when=t.requires_grad)
            logits = ctx.graph.new("logits_capped", logits.shape, logits.dims, logits.dtype, logits.requires_grad)
    return logits


def _policy(ctx: Ctx) -> OpPolicy | None:
    """A fresh op-level policy per checkpointed block under ``recompute='op'`` (torchtitan builds
    one per checkpoint call: ``context_fn`` runs per forward of the wrapped block)."""
    return OpPolicy() if ctx.impl.recompute == "op" else None


def _checkpoint_extras(ctx: Ctx, kernel: str, dtype: str, positions: Sym | None = None,
                       root: str = "model") -> list[Sym]:
    """Block inputs besides the hidden state that a checkpointed block holds: the position
    ids and, for eager attention, the materialized causal mask (B, 1, S, S)."""
    if ctx.impl.recompute == "none":
        return []
    g = ctx.graph
    held = []
    # selective checkpoints only the attention function, which still gets the position ids: the
    # decoder layer passes position_ids=... on and LlamaAttention.forward (modeling_llama.py) has no
    # such parameter, so they reach attention_interface in **kwargs, held by each checkpoint
    held.append(positions or g.new("model.position_ids", (1, ctx.S), ("1", "S"), "int64", False))
    if kernel == "eager":
        held.append(g.new(f"{root}.causal_mask", (ctx.B, 1, ctx.S, ctx.S), ("B", "1", "S", "S"), dtype, False))
    return held


def _eager_window_masks(ctx: Ctx, kernel: str, held: list[Sym], dtype: str) -> list[Sym]:
    """What a checkpointed sliding block holds under eager attention when the model has full blocks
    too: Gemma-2/3, Qwen2/Qwen3 build a mask per layer type (``modeling_gemma2.Gemma2Model.forward``:
    ``causal_mask_mapping`` of ``create_causal_mask`` and ``create_sliding_window_causal_mask``), and
    ``masking_utils.eager_mask`` materializes each, window reached or not (``allow_is_causal_skip=False``):
    a second (B, 1, S, S) additive mask in the activations' dtype, held by the sliding blocks'
    checkpoints instead of the causal one. (Mistral's one sliding mask is ``held``'s causal_mask.)"""
    kinds = {k.attention for k in ctx.model.kinds}
    if kernel != "eager" or not held or "sliding" not in kinds or kinds == {"sliding"}:
        return held
    sliding = ctx.graph.new("model.sliding_window_mask", (ctx.B, 1, ctx.S, ctx.S), ("B", "1", "S", "S"), dtype, False)
    return held[:-1] + [sliding]


# --- Llama family --------------------------------------------------------------------------

def _llama(ctx: Ctx) -> None:
    g, m, rules = ctx.graph, ctx.model, _rules(ctx)
    gemma = rules.unit_offset_norm
    x = _embedding(ctx, "model.embed_tokens")
    if rules.scaled_embedding:  # the scaled embedding multiplies by sqrt(H): a new tensor, keeps only the scalar
        # (GemmaTextScaledWordEmbedding.forward: `* self.embed_scale.to(self.weight.dtype)`, a 0-d tensor)
        g.save(g.new("model.embed_tokens.embed_scale", (), (), x.dtype, False), when=x.requires_grad)
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
    h = _rmsnorm(ctx, x, "model.norm", gemma=gemma)
    if m.head != "lm":
        return task_head(ctx, h)
    with g.module("lm_head"):
        h = ctx.sp_gather(h, "input_gathered")
    logits = _head(ctx, h, "lm_head")
    _loss(ctx, logits)


def _llama_layer(ctx: Ctx, x: Sym, cos: Sym, sin: Sym, kernel: str, held: list[Sym] = (), *,
                 masked: bool = False, moe: bool = False) -> Sym:
    g, m, rules = ctx.graph, ctx.model, _rules(ctx)
    gemma = rules.unit_offset_norm
    H, qs, kvs = m.hidden_size, m.q_size, m.kv_size
    post = rules.post_norms  # OLMo-2: no norm before attention or the MLP, one after each
    h = x if post else _rmsnorm(ctx, x, "input_layernorm", gemma=gemma)
    with g.module("self_attn"):
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
        # the KV cache's torch.cat hands attention fresh copies of K and V
        k = g.new("k_cache", k.shape, k.dims, k.dtype, k.requires_grad)
        v = g.new("v_cache", (ctx.B, ctx.S, kvs), ("B", "S", "Akv·hd"), v.dtype, v.requires_grad)
        gqa_native = kernel != "eager"  # transformers' use_gqa_in_sdpa: no mask, head_dim <= 256
        with g.checkpoint(q, k, v, *held) if ctx.impl.recompute == "selective" else nullcontext():
            o = attention_core(ctx, q, k, v, kernel=kernel, gqa_native=gqa_native and m.head_dim <= 256,
                               softcap=m.attn_softcap, out_copy=rules.fused_qkv, masked=masked)
        with g.module("o_proj"):
            a = ctx.sp_scatter(ctx.linear(o, H, "H", weight=(H, qs), bias=m.out_bias), "out_sp")
    if rules.sandwich_norms or post:
        a = _rmsnorm(ctx, a, "post_attention_layernorm", gemma=gemma)
    x = ctx.add(x, a, "residual_attn")
    norm2 = "pre_feedforward_layernorm" if rules.sandwich_norms else "post_attention_layernorm"
    h = x if post else _rmsnorm(ctx, x, norm2, gemma=gemma)
    with g.module("mlp"):
        h = ctx.sp_gather(h, "input_gathered")
        y = _moe(ctx, h) if moe else _gated_mlp(ctx, h)
        y = ctx.sp_scatter(y, "out_sp")
    if rules.sandwich_norms or post:
        y = _rmsnorm(ctx, y, "post_feedforward_layernorm", gemma=gemma)
    return ctx.add(x, y, "residual_mlp")


def _qkv_proj(ctx: Ctx, h: Sym) -> tuple[Sym, Sym, Sym]:
    """Separate ``q_proj``, ``k_proj``, ``v_proj`` linears (biased with ``qkv_bias``); each keeps ``h``."""
    g, m = ctx.graph, ctx.model
    H, qs, kvs = m.hidden_size, m.q_size, m.kv_size
    with g.module("q_proj"):
        q = ctx.linear(h, qs, "A·hd", weight=(qs, H), bias=m.qkv_bias)
    with g.module("k_proj"):
        k = ctx.linear(h, kvs, "Akv·hd", weight=(kvs, H), bias=m.qkv_bias)
    with g.module("v_proj"):
        v = ctx.linear(h, kvs, "Akv·hd", weight=(kvs, H), bias=m.qkv_bias)
    return q, k, v


def _heads(x: Sym, heads: int, heads_sym: str, hd: int) -> Sym:
    """A (B, S, heads, hd) view: per-head norms see this shape (their statistics are per head)."""
    return Sym(x.name, x.shape[:-1] + (heads, hd), x.dims[:-1] + (heads_sym, "hd"), x.dtype)


def _gated_mlp(ctx: Ctx, h: Sym, width: tuple[int, str] | None = None) -> Sym:
    """gate/up projections, act(gate) * up, down projection: 4·B·S·F kept (+ input).
    ``width``: the intermediate size and its symbol, when not the model's ``ffn_size`` (F)."""
    g, m = ctx.graph, ctx.model
    H = m.hidden_size
    F, Fs = width or (m.ffn_size, "F")
    if not m.gated:
        with g.module("up_proj"):
            u = ctx.linear(h, F, Fs, weight=(F, H), bias=m.mlp_bias)
        with g.module("act_fn"):
            a = _activation(ctx, u, "act")
        with g.module("down_proj"):
            return ctx.linear(a, H, "H", weight=(H, F), bias=m.mlp_bias)
    fused = _rules(ctx).fused_gate_up
    if fused:
        with g.module("gate_up_proj"):
            gu = ctx.linear(h, 2 * F, f"2{Fs}", weight=(2 * F, H), bias=m.mlp_bias)
        gate = up = gu
        shape, dims = gu.shape[:-1] + (F,), gu.dims[:-1] + (Fs,)
    else:
        with g.module("gate_proj"):
            gate = ctx.linear(h, F, Fs, weight=(F, H), bias=m.mlp_bias)
        with g.module("up_proj"):
            up = ctx.linear(h, F, Fs, weight=(F, H), bias=m.mlp_bias)
        shape, dims = gate.shape, gate.dims
    with g.module("activation_fn" if fused else "act_fn"):
        g.save(gate, when=gate.requires_grad)
        act = g.new("out", shape, dims, gate.dtype, gate.requires_grad)
    prod = ctx.mul(act, up, "act_mul_up", shape=shape, dims=dims)
    with g.module("down_proj"):
        return ctx.linear(prod, H, "H", weight=(H, F), bias=m.mlp_bias)


def _moe(ctx: Ctx, h: Sym) -> Sym:
    """Mixtral sparse MoE, transformers 5 ``grouped_mm`` experts.

    Every routed tensor has T·k rows (T = B·S tokens), so the total is independent of how
    tokens spread over experts.
    """
    g, m = ctx.graph, ctx.model
    H, E, k = m.hidden_size, m.num_experts, m.top_k
    T = ctx.B * ctx.S
    with g.module("gate"):
        logits = ctx.linear(h, E, "E", weight=(E, H))
        probs = g.new("probs", (T, E), ("B·S", "E"), "float32")  # softmax keeps its fp32 output
        # torch.topk's values and indices (MixtralTopKRouter.forward, Qwen3MoeTopKRouter.forward): an
        # op-level policy keeps both (aten.topk is on op_sac_context's save list); autograd the indices
        top_val = g.new("top_val", (T, k), ("B·S", "k"), "float32", op="topk")
        g.save(probs, g.new("top_idx", (T, k), ("B·S", "k"), "int64", False, op="topk"))
        # the in-place renormalization keeps the sum and the top-k values (Qwen3-MoE may skip it)
        g.save(g.new("top_sum", (T, 1), ("B·S", "1"), "float32"), top_val, when=m.router_norm_topk)
        # Qwen3MoeTopKRouter.forward casts the weights to the logits' dtype; Mixtral's stay fp32
        w_dtype = logits.dtype if _rules(ctx).router_cast else "float32"
        del logits
    return _routed_experts(ctx, h, w_dtype)


def _routed_experts(ctx: Ctx, h: Sym, w_dtype: str) -> Sym:
    """The ``grouped_mm`` experts (``integrations/moe.py``) after a router whose top-k weights are
    ``w_dtype``, and the shared experts' dense MLP where the model has them."""
    g, m = ctx.graph, ctx.model
    H, E, k, F = m.hidden_size, m.num_experts, m.top_k, m.expert_ffn_size
    T = ctx.B * ctx.S
    # grouped_mm is on CUDA autocast's lower-precision list, not on CPU's
    low = ctx.low if ctx.impl.device == "cuda" else None
    act = low or (ctx.param if ctx.low else h.dtype)
    Tk = (T * k,)
    with g.module("experts"):
        Tks = ("B·S·k",)
        g.save(g.new("sort_idx", Tk, Tks, "int64"), g.new("token_idx", Tk, Tks, "int64"),
               g.new("counts", (E,), ("E",), "int32"), g.new("routed_idx", Tk, Tks, "int64"))
        x_in = g.new("gathered", (T * k, H), Tks + ("H",), act)
        gu = g.new("gate_up", (T * k, 2 * F), Tks + ("2Fe",), act)
        with g.module("act_fn"):
            a = g.new("out", (T * k, F), Tks + ("Fe",), act)
        p = g.new("act_mul_up", (T * k, F), Tks + ("Fe",), act)
        w = g.new("weights", (T * k, 1), Tks + ("1",), w_dtype)
        d = g.new("down", (T * k, H), Tks + ("H",), act)
        g.save(x_in, gu, a, p, w, d)
        if low:
            g.save(g.new("gate_up_weight_cast", (E, 2 * F, H), ("E", "2Fe", "H"), ctx.low),
                   g.new("down_weight_cast", (E, H, F), ("E", "H", "Fe"), ctx.low))
    y = g.new("moe_out", h.shape, h.dims, promote(act, "float32") if low else act)
    if m.num_shared_experts:
        # DeepSeek (modeling_deepseek_v3.py, DeepseekV3MoE.forward): routed output +
        # shared_experts(input), one dense MLP as wide as all shared experts; the sum keeps nothing
        with g.module("shared_experts"):
            shared = _gated_mlp(ctx, h, (m.num_shared_experts * F, "Es·Fe"))
        y = ctx.add(y, shared, "moe_shared_sum")
    return y


# --- GPT-2 / GPT-NeoX ------------------------------------------------------------------------

def _gpt(ctx: Ctx) -> None:
    g, m = ctx.graph, ctx.model
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
    held = _checkpoint_extras(ctx, kernel, x.dtype, positions, root)
    def layer(i: int, x: Sym) -> Sym:
        if ctx.impl.checkpointed(i):
            with g.checkpoint(*[t for t in (x, cos, sin, *held) if t is not None], policy=_policy(ctx)):
                return _gpt_layer(ctx, x, kernel, cos, sin)
        return _gpt_layer(ctx, x, kernel, cos, sin, [t for t in held if t.dtype != "int64"])

    x = _layers(ctx, f"{root}.{layers}.", x, layer)
    h = _layernorm(ctx, x, f"{root}.final_layer_norm" if neox else f"{root}.ln_f")
    if m.head != "lm":
        return task_head(ctx, h)
    logits = _head(ctx, h, "lm_head")
    _loss(ctx, logits)


def _gpt_layer(ctx: Ctx, x: Sym, kernel: str, cos, sin, held: list[Sym] = ()) -> Sym:
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
        k = g.new("k_cache", *heads, k.dtype, k.requires_grad)
        v = g.new("v_cache", *heads, qkv.dtype, qkv.requires_grad)
        with g.checkpoint(q, k, v, *held) if ctx.impl.recompute == "selective" else nullcontext():
            o = attention_core(ctx, q, k, v, kernel=kernel, gqa_native=True, softmax_fp32=neox, out_copy=neox,
                               q_copy=not neox and kernel in ("eager", "math"))
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
    x = _embedding(ctx, "bert.embeddings.word_embeddings")
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
    _loss(ctx, logits, upcast=False)


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
