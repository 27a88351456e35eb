"""The shared pieces of the ``hf`` profile's block rules (``rules_hf``): the per-kind template
runner over the blocks (``_layers``), embeddings, RMSNorm/LayerNorm, rotary embedding,
activations, the q/k/v and gated-MLP projections, the language-model head and loss, and the
family's :class:`~trainmem.families.BlockRules` switches. Each models what transformers 5.x's
module keeps for backward; the model-level forwards (``rules_hf``, ``rules_gpt_oss``,
``rules_llama4``, ``rules_mla``, ``rules_compiled``) assemble them.
"""

from __future__ import annotations

from trainmem.estimate.ctx import Ctx, promote
from trainmem.estimate.graph import OpPolicy, Sym
from trainmem.estimate.losses import FRAMEWORK_LOSSES, framework_loss_items, torchtune_head
from trainmem.estimate.loss_value import loss_value
from trainmem.families import BlockRules, family_of, token_embedding_modules
from trainmem.names import EMBEDDING_INDICES, EMBEDDING_OUTPUT


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

def _embedding(ctx: Ctx, name: str, *, positions: bool = False, ids: Sym | None = None) -> Sym:
    """``nn.Embedding``: keeps the indices; the output is a new tensor in the weight's dtype.
    ``positions``: a position embedding, indexed by (1, S) position ids; ``ids``: the token ids, made by the caller
    (:func:`token_ids`) where another node keeps them too."""
    g = ctx.graph
    shape, dims = ((1, ctx.S), ("1", "S")) if positions else ((ctx.B, ctx.S), ("B", "S"))
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
        if not wt and (ctx.impl.recompute in ("full", "every-k") or ctx.checkpointed) and name in token_embedding_modules():
            # fine-tuning: HF's gradient_checkpointing_enable() calls enable_input_require_grads(),
            # so a frozen token embedding's output becomes a leaf that requires grad (the graph holds it);
            # the blocks' recomputed set (Ctx.checkpointed) is made from it too: block 0 saves what every block saves
            out.requires_grad = True
            g.save(out)
        return out


def token_ids(ctx: Ctx, name: str) -> Sym:
    """The model's (B, S) int64 token ids, the input of token embedding ``name``, named by it."""
    with ctx.graph.module(name):
        return ctx.graph.new(EMBEDDING_INDICES, (ctx.B, ctx.S), ("B", "S"), "int64", False, input=True)


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


def _loss(ctx: Ctx, logits: Sym, *, upcast: bool = True, labels: Sym | None = None) -> None:
    """HF ``ForCausalLMLoss``: ``logits.float()``, log_softmax keeps its output, nll_loss keeps
    the shifted targets and the total weight. ``labels``: BERT's MLM loss (``BertForMaskedLM.forward``:
    ``CrossEntropyLoss()(prediction_scores.view(-1, V), labels.view(-1))``) keeps a view of the caller's labels,
    no shifted copy: the token ids, as ``labels=ids`` passes them (trace/step.py)."""
    g = ctx.graph
    B, S, V = ctx.B, ctx.S, ctx.model.vocab_size
    with g.module("loss"):
        if ctx.step.loss in FRAMEWORK_LOSSES:  # torchtune's / LitGPT's chunked CE (estimate/losses.py)
            return framework_loss_items(ctx, logits)
        # ForCausalLMLoss pads and shifts the labels before cross_entropy: the targets come first
        target = g.new("target", *_target_shape(B, S), "int64", False) if labels is None else labels
        dtype = "float32"  # chunked-ce / fused-ce accumulate the loss in fp32
        if ctx.step.loss == "ce":
            # HF causal LMs upcast; autocast runs cross_entropy in fp32 anyway
            dtype = "float32" if upcast or ctx.low else logits.dtype
            g.save(g.new("log_softmax", (B * S, V), ("B·S", "V"), dtype), when=logits.requires_grad)
        elif ctx.step.loss == "fused-ce":
            # fused linear+CE computes d(hidden) in forward and keeps it for backward
            g.save(g.new("grad_hidden", (B, S, ctx.model.hidden_size), ("B", "S", "H"), logits.dtype))
        loss_value(g, dtype)  # nll_loss's output, made before its total weight (estimate/loss_value.py)
        # aten nll_loss_forward makes total_weight in its input's dtype (BERT's MLM loss: bf16, no upcast)
        g.save(target, g.new("total_weight", (), (), dtype, False), when=logits.requires_grad)


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
    if ctx.step.loss in FRAMEWORK_LOSSES and not ctx.impl.compile:  # one head matmul per chunk (losses.py)
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


def _two_matrix_mlp(ctx: Ctx, h: Sym, names: tuple[str, str, str], width: tuple[int, str] | None = None) -> Sym:
    """Up projection, one activation kernel, down projection (``names``: the three modules; a non-gated
    Llama-style MLP's, GPT-BigCode's ``c_fc``, ``act``, ``c_proj``). ``width``: as :func:`_gated_mlp`'s."""
    g, m = ctx.graph, ctx.model
    H = m.hidden_size
    F, Fs = width or (m.ffn_size, "F")
    up, act, down = names
    with g.module(up):
        u = ctx.linear(h, F, Fs, weight=(F, H), bias=m.mlp_bias)
    with g.module(act):
        a = _activation(ctx, u, "act")
    with g.module(down):
        return ctx.linear(a, H, "H", weight=(H, F), bias=m.mlp_bias)


def _gated_mlp(ctx: Ctx, h: Sym, width: tuple[int, str] | None = None) -> Sym:
    """gate/up projections, act(gate) * up, down projection: 4·B·S·F kept (+ input).
    ``width``: the intermediate size and its symbol, when not the model's ``ffn_size`` (F)."""
    g, m = ctx.graph, ctx.model
    H = m.hidden_size
    F, Fs = width or (m.ffn_size, "F")
    if not m.gated:
        return _two_matrix_mlp(ctx, h, ("up_proj", "act_fn", "down_proj"), (F, Fs))
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
