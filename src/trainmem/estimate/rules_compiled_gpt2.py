"""``ImplSpec.compile`` for GPT-2 (``modeling_gpt2.py`` ``GPT2LMHeadModel``): what a compiled step keeps
for backward, read from its partitioned graphs (``trainmem trace --compile``: inductor's decompositions,
joint-graph passes and ``min_cut_rematerialization_partition``, ``torch/_functorch/partitioners.py``).

GPT-2's block differs from the Llama one (``rules_compiled.py``) in its LayerNorm, fused ``c_attn``
``Conv1D``, learned positions and python GELU-tanh (``gelu_new``). A block keeps (a the activation
dtype, ``A·hd = H``):

* each LayerNorm's output, the next ``Conv1D``'s input (its ``addmm`` reads it for the weight's
  gradient); the normalized product and GELU's tanh chain are recomputed;
* ``c_attn``'s output (B·S·3H): SDPA's q is a strided view of it; k and v reach SDPA as contiguous
  copies (B·A·S·hd each), which it keeps with its output and fp32 log-sum-exp (``estimate/attention.py``
  ``fused_saves``);
* ``c_fc``'s output (GELU's input, B·S·F) and GELU's output (``c_proj``'s input, B·S·F).

What each LayerNorm's backward reads depends on where it sits (``native_layer_norm`` decomposed in
``torch/_refs/__init__.py``: mean and rstd in the input's dtype on CPU, fp32 on CUDA):

* one region per block (``--compile-scope block``/``block-loss``): the block input and both norms'
  mean and rstd, and ``c_proj``'s output, from which the residual sum is recomputed;
* the whole model in 16-bit: each norm's input (the block input, the residual sum; the first norm's is
  recomputed from the token and position embeddings' outputs, both kept) and its mean and rstd;
* the whole model in fp32: the normalized product (fp32 either way, now no larger than the input) and
  ``rstd / H`` (B·S·1), except the first norm, which keeps the embeddings and its mean and rstd when
  the min-cut weighs them lighter (:func:`_embeddings_kept`).

The loss keeps what the Llama rules' compiled cross-entropy keeps (``rules_compiled._compiled_loss``;
GPT-2's model graph-breaks before it, a region of its own).

    per block, one region per block   a·B·S·(10H + 2F) + 4·s·B·S + 4·B·A·S     s = mean/rstd bytes

Under ``--recompute full`` each checkpointed block keeps its input: whole-model compile keeps the
embeddings' outputs instead of the first (the sum is recomputed), the causal mask (B·1·S·S, a), the
final norm's mean and rstd (its input is recomputed with the last block) and its output; per block,
as the Llama rules (``rules_compiled._checkpointed_block``). Each recomputed SDPA also replays a CPU
generator state (5056 B of host memory, left out as in the Llama rules).

Checked (``tests/estimate/test_compiled_gpt2.py``): dropout 0.0 (nanoGPT's); fp32, bf16 and fp16 under every
scope, amp-bf16 per block; --recompute none and full; the SDPA kernel. Dropout above 0 is refused in
``rules_compiled.check_compiled``: on CPU inductor's ``replace_random_passes`` keeps a bool mask per
dropout and SDPA with dropout decomposes into its math ops (scores, softmax statistics, a
B·A·S·S mask), a different saved set (docs/compile.md).

Known limitations:
  - Checked on CPU kernels only (the tracer runs them whatever ``--device``): on CUDA the norms' 16-bit
    mean and rstd are fp32 by the decomposition's source, not traced; the k/v copies and the min-cut's
    choices are assumed to carry over, and the CUDA SDPA kernels keep their own log-sum-exp layout.
  - The first norm's choice (:func:`_embeddings_kept`) uses the distances read from one graph; near its
    threshold (B=2, H about 346) the int truncations of the real weights may tip it the other way.
"""

from __future__ import annotations

from trainmem.estimate.attention import fused_saves, resolve_kernel
from trainmem.estimate.ctx import Ctx, Shard
from trainmem.estimate.graph import Sym
from trainmem.estimate.rules_compiled import _checkpointed_block, _compiled_loss, _weight_copies
from trainmem.estimate.rules_hf_parts import _embedding, _head, _layernorm, _layers, _loss

__all__ = ["forward", "refusals"]

ROOT = "transformer"


def refusals(ctx: Ctx) -> list[tuple[str, object, bool, str]]:
    """What GPT-2's compiled rules were not checked on, as ``rules_compiled.check_compiled``'s rows."""
    impl, step, m = ctx.impl, ctx.step, ctx.model
    return [
        ("recompute", impl.recompute, impl.recompute not in ("none", "full"),
         "GPT-2's compiled rules cover --recompute none and full"),
        ("precision", step.precision, step.recipe not in ("fp32", "bf16", "fp16", "amp-bf16"),
         "GPT-2's compiled rules cover fp32, bf16, fp16, and amp-bf16 per block"),
        ("attention", impl.attention, resolve_kernel(ctx) not in ("flash", "efficient"),
         "GPT-2's compiled rules need a fused SDPA kernel (sdpa, flash, mem-efficient)"),
        ("activation", m.activation, m.activation != "gelu_tanh", "GPT-2's compiled rules cover gelu_new"),
        ("float8", impl.float8, impl.float8 != "none", "GPT-2's compiled rules have no Float8 linears"),
        ("finetune", "on", ctx.finetune_linear is not None, "GPT-2's compiled rules cover full training"),
        ("head", m.head, m.head != "lm", "GPT-2's compiled rules cover GPT2LMHeadModel"),
        ("loss", step.loss, step.loss != "ce", "GPT-2's compiled rules cover the full cross-entropy"),
        ("parallel", "sharded", ctx.shard != Shard(), "GPT-2's compiled rules cover one device"),
    ]


def forward(ctx: Ctx) -> None:
    """The compiled saved set of one GPT-2 step, for ``ctx.impl.compile_scope``."""
    if ctx.impl.compile_scope == "model":
        return _whole_model(ctx)
    x = ctx.add(_embedding(ctx, f"{ROOT}.wte"), _embedding(ctx, f"{ROOT}.wpe", positions=True), f"{ROOT}.embed_sum")
    block = _checkpointed_block if ctx.impl.recompute == "full" else _block
    x = _layers(ctx, f"{ROOT}.h.", x, lambda _i, x: block(ctx, x))
    logits = _head(ctx, _layernorm(ctx, x, f"{ROOT}.ln_f"), "lm_head")
    if ctx.impl.compile_scope == "block-loss":  # torchtune's compile_loss: the loss is its own region
        return _compiled_loss(ctx, logits)
    _loss(ctx, logits)


def _whole_model(ctx: Ctx) -> None:
    g, m = ctx.graph, ctx.model
    B, S, H, a = ctx.B, ctx.S, m.hidden_size, ctx.param
    wte, wpe = _embedding(ctx, f"{ROOT}.wte"), _embedding(ctx, f"{ROOT}.wpe", positions=True)
    x = ctx.add(wte, wpe, f"{ROOT}.embed_sum")
    full = ctx.impl.recompute == "full"
    if full or _embeddings_kept(ctx):  # the first norm's input, recomputed from both outputs
        g.save(wte, wpe)
    if full:
        with g.module(ROOT):
            g.save(g.new("causal_mask", (B, 1, S, S), ("B", "1", "S", "S"), a, False))

        def layer(i: int, x: Sym) -> Sym:
            g.save(x, when=i > 0)  # the first block's input: the embeddings' sum
            return g.new("residual_mlp", x.shape, x.dims, a)

        x = _layers(ctx, f"{ROOT}.h.", x, layer)
        _norm(ctx, x, f"{ROOT}.ln_f", keep_input=False, stats=True)  # its input is recomputed with the last block
    else:
        _norm(ctx, _layers(ctx, f"{ROOT}.h.", x, lambda i, x: _model_block(ctx, x, first=i == 0)), f"{ROOT}.ln_f")
    with g.module("lm_head"):
        logits = g.new("out", (B, S, m.vocab_size), ("B", "S", "V"), a)
    # GPT-2's model graph-breaks before its loss (trace --compile: two regions), which is a region of its own
    # as under block-loss: its items are the top-level loss's, whose backward moment peak.py models
    _compiled_loss(ctx, logits)


def _model_block(ctx: Ctx, x: Sym, *, first: bool) -> Sym:
    """One block inside the whole-model region; ``first``: its input is the embeddings' sum."""
    # the first norm's input is recomputed from the embeddings (kept by _whole_model) or not read at all
    _norm(ctx, x, "ln_1", keep_input=not first, stats=True if first and _embeddings_kept(ctx) else None)
    _norm(ctx, _attention(ctx, x, keep_out=False), "ln_2")
    _mlp(ctx)
    return ctx.graph.new("residual_mlp", x.shape, x.dims, x.dtype)


def _block(ctx: Ctx, x: Sym) -> Sym:
    """One block compiled alone (torchtitan's ``apply_compile``, ``trace/compiled.py`` ``_compile_blocks``):
    it keeps its input, both norms' mean and rstd and ``c_proj``'s output; under autocast the 16-bit
    weight copies too (``rules_compiled._weight_copies``: Conv1D weights are ``[in, out]``)."""
    g, m = ctx.graph, ctx.model
    H, F = m.hidden_size, m.ffn_size
    g.save(x)
    _norm(ctx, x, "ln_1", keep_input=False, stats=True)
    _norm(ctx, _attention(ctx, x, keep_out=True), "ln_2", keep_input=False, stats=True)
    _mlp(ctx)
    with g.module("attn"):
        _weight_copies(ctx, ("c_attn", H, "H", 3 * H, "3H"), ("c_proj", H, "H", H, "H"))
    with g.module("mlp"):
        _weight_copies(ctx, ("c_fc", H, "H", F, "F"), ("c_proj", F, "F", H, "H"))
    return g.new("residual_mlp", x.shape, x.dims, x.dtype)  # the residual stream stays in x's dtype


def _attention(ctx: Ctx, x: Sym, *, keep_out: bool) -> Sym:
    """``c_attn``, SDPA and ``c_proj`` (``keep_out``: its output); returns the residual sum."""
    g, m = ctx.graph, ctx.model
    B, S, H, A, hd, a = ctx.B, ctx.S, m.hidden_size, m.num_heads, m.head_dim, ctx.low or ctx.param
    heads, heads_dims = (B, A, S, hd), ("B", "A", "S", "hd")
    with g.module("attn"):
        with g.module("c_attn"):
            qkv = g.new("out", (B, S, 3 * H), ("B", "S", "3H"), a)  # q is a strided view of it
        k, v = g.new("k", heads, heads_dims, a), g.new("v", heads, heads_dims, a)  # contiguous copies
        fused_saves(ctx, qkv, k, v, resolve_kernel(ctx), (B, S, H), ("B", "S", "H"))
        with g.module("c_proj"):
            g.save(g.new("out", (B, S, H), ("B", "S", "H"), a), when=keep_out)
    return g.new("residual_attn", x.shape, x.dims, x.dtype)


def _mlp(ctx: Ctx) -> None:
    """``c_fc``, ``gelu_new`` and ``c_proj``: keeps GELU's input and output (``c_proj``'s input)."""
    g = ctx.graph
    with g.module("mlp"):
        for name in ("c_fc", "act"):
            with g.module(name):
                g.save(g.new("out", (ctx.B, ctx.S, ctx.model.ffn_size), ("B", "S", "F"), ctx.low or ctx.param))


def _norm(ctx: Ctx, x: Sym, name: str, *, keep_input: bool = True, stats: bool | None = None) -> Sym:
    """A compiled LayerNorm: keeps its output (the next Conv1D's input) and either its input with its
    mean and rstd (``stats``) or the fp32 normalized product and ``rstd / H`` (the whole-model fp32
    default, :func:`_embeddings_kept`). Returns its output."""
    g = ctx.graph
    B, S = ctx.B, ctx.S
    stats = ctx.param != "float32" or ctx.impl.compile_scope != "model" if stats is None else stats
    with g.module(name):
        if stats:
            g.save(x, when=keep_input)
            dt = "float32" if ctx.impl.device == "cuda" else x.dtype  # torch/_refs native_layer_norm
            g.save(*(g.new(stat, (B, S, 1), ("B", "S", "1"), dt, False) for stat in ("mean", "rstd")))
        else:
            g.save(g.new("normed", x.shape, x.dims, "float32", False),
                   g.new("rstd_over_h", (B, S, 1), ("B", "S", "1"), "float32", False))
        out = g.new("out", x.shape, x.dims, ctx.low or x.dtype)
        g.save(out)
    return out


#: node weight = bytes·1.1^d (d: edges to the nearest backward use, at least 1), doubled unless a
#: non-fusible op reads it (``partitioners.py`` ``get_node_weight``, ``is_materialized``); the
#: distances of the first norm's candidates in GPT-2's joint graph (read from it, fp32, B=2 S=64)
_DIST = {"embedding": 4, "mean": 3, "normed": 1, "rstd": 1}


def _weight(nbytes: int, dist: int, materialized: bool) -> int:
    return int(nbytes * 1.1 ** max(min(dist, 100), 1)) * (1 if materialized else 2)


def _embeddings_kept(ctx: Ctx) -> bool:
    """Whole-model compile: the first LayerNorm's backward reads either its input (recomputed from the
    token and position embeddings' outputs, ``embedding`` ops: materialized) with mean and rstd, or the
    normalized product (pointwise-fused: doubled) with ``rstd / H``; the min-cut keeps the lighter set.
    16-bit: the normalized product is fp32, the embeddings always. fp32: the embeddings from B = 3 on,
    at B = 2 for H above about 346, never at B = 1 (tiny GPT-2, H=64: B=2 keeps the normalized product)."""
    if ctx.param != "float32" or ctx.impl.recompute == "full":
        return True
    B, S, H = ctx.B, ctx.S, ctx.model.hidden_size
    stat = 4 * B * S
    embeddings = (_weight(4 * B * S * H, _DIST["embedding"], True) + _weight(4 * S * H, _DIST["embedding"], True)
                  + _weight(stat, _DIST["mean"], True) + _weight(stat, _DIST["rstd"], False))
    normed = _weight(4 * B * S * H, _DIST["normed"], False) + _weight(stat, _DIST["rstd"], False)
    return embeddings < normed
