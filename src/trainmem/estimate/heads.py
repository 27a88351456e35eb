"""Task heads: what a classification head adds to the parameters and to the saved set.

``ModelSpec.head`` picks the head transformers' Auto class builds on the same base model:

* ``lm`` / ``mlm`` -- the language-model heads, modelled in ``rules_hf.py`` (``lm_head``,
  BERT's ``cls.predictions``) and ``params.py``.
* ``seq-cls`` -- ``AutoModelForSequenceClassification``. Decoders
  (``transformers/modeling_layers.py`` ``GenericForSequenceClassification.forward``,
  ``GPT2ForSequenceClassification``, ``GPTNeoXForSequenceClassification``): ``score`` (no bias)
  maps every token to ``num_labels`` logits, the last non-pad token's row is picked with
  ``logits[arange(B), last_non_pad_token]`` (aten.index keeps its two (B,) int64 indices, not the
  logits), cross-entropy on (B, num_labels) without an upcast (``loss_utils.py``
  ``ForSequenceClassificationLoss``). BERT (``BertForSequenceClassification``, ``BertPooler``):
  the pooler's dense reads ``hidden[:, 0]`` -- a view, so addmm keeps the whole (B, S, H) storage
  -- then tanh (keeps its output), dropout, ``classifier`` (bias) and CrossEntropyLoss.
* ``token-cls`` -- ``AutoModelForTokenClassification``: dropout (``classifier_dropout``), a
  linear to ``num_labels`` per token (``score`` with bias for the generic decoders, ``classifier``
  for GPT-2/GPT-NeoX/BERT) and cross-entropy over (B·S, num_labels); ``ForTokenClassification``
  (generic decoders, GPT-NeoX) upcasts the logits to fp32, GPT-2's and BERT's inline
  ``CrossEntropyLoss`` does not.

No [B, S, V] logits exist: a classifier's logits are B·S·num_labels (token-cls and decoders'
seq-cls) wide, so the loss phases use ``num_labels`` where the LM heads use the vocabulary.

Known limitations:
  - Single-label classification (integer labels, ``num_labels`` > 1) only: regression
    (``num_labels`` = 1, MSE) and multi-label (BCE) are not modelled.
  - peft's ``modules_to_save`` (a trainable head next to LoRA adapters) is not modelled: under
    lora/qlora the head is frozen like the rest of the base.
  - Checked on CPU against real models (tests/estimate/test_heads.py); tensor/sequence parallel
    cuts of a classification head are refused.
"""

from __future__ import annotations

from trainmem.estimate.graph import Sym
from trainmem.estimate.loss_value import loss_value
from trainmem.families import TaskHeads, family_of, output_layers, task_head_modules
from trainmem.names import under
from trainmem.specs import ModelSpec

__all__ = ["TaskHead", "head_layout", "head_parameters", "task_head", "logits_width", "classifier_dropout", "check_head",
           "is_classifier", "classifier_forward_held"]

Shape = tuple[int, ...]


TaskHead = TaskHeads  # each family declares its heads (``Family.task_heads``, trainmem/families/)


def head_layout(model: ModelSpec) -> TaskHeads:
    """The model's classification heads, as its family declares them (an encoder spec's may differ)."""
    fam = family_of(model)
    if model.arch == "encoder" and fam.encoder_task_heads is not None:
        return fam.encoder_task_heads
    return fam.task_heads


def classifier_dropout(model: ModelSpec) -> float:
    """The dropout in front of the classifier: ``config.classifier_dropout`` when set, else
    BERT's ``hidden_dropout_prob`` (``BertFor*Classification.__init__``) or 0.1 (decoders' token
    classifiers: ``GenericForTokenClassification``, ``GPT2ForTokenClassification``,
    ``GPTNeoXConfig.classifier_dropout``). Decoders' sequence classifiers have none."""
    if model.head == "seq-cls" and head_layout(model).pooler is None:
        return 0.0
    if model.classifier_dropout is not None:
        return model.classifier_dropout
    return model.hidden_dropout if model.arch == "encoder" else 0.1


def logits_width(model: ModelSpec) -> int:
    """Columns of the logits the loss reads: the vocabulary for LM heads, else ``num_labels``."""
    return model.vocab_size if model.head in ("lm", "mlm") else model.num_labels


def head_parameters(model: ModelSpec, params: list[tuple[str, Shape]]) -> list[tuple[str, Shape]]:
    """The LM-head layout ``params`` with its head swapped for ``model.head``'s."""
    if model.head in ("lm", "mlm"):
        return params
    lay, H, nl = head_layout(model), model.hidden_size, model.num_labels
    lm_head = tuple(dict.fromkeys(layer.partition(".")[0] + "." for layer in output_layers()))  # lm_head., cls.
    out = [(n, s) for n, s in params if not n.startswith(lm_head)]
    seq = model.head == "seq-cls"
    if seq and lay.pooler:
        out += [(f"{lay.pooler}.dense.weight", (H, H)), (f"{lay.pooler}.dense.bias", (H,))]
    module, bias = (lay.seq_module, lay.seq_bias) if seq else (lay.tok_module, lay.tok_bias)
    out.append((f"{module}.weight", (nl, H)))
    if bias:
        out.append((f"{module}.bias", (nl,)))
    return out


def is_classifier(name: str) -> bool:
    """A classification head's linear (``score``, ``classifier``) or one of its states: never tied to the
    token embedding, so the embedding's gradient comes last in backward (``estimate/peak.py`` ``layer_stats``)."""
    return under(name, task_head_modules())


def classifier_forward_held(model: ModelSpec, step) -> int:
    """Bytes a decoder's classification forward holds at its loss that no backward node saved, besides the KV cache
    and autocast's weight copies (``estimate/forward_held.py``): the final norm's output (B, S, H in the weights'
    dtype: Llama's RMSNorm returns ``weight * x.to(input_dtype)``), bound by the model output
    (``GenericForTokenClassification.forward``: ``outputs``; ``GenericForSequenceClassification.forward``:
    ``transformer_outputs``) while ``self.loss_function`` runs, where the head saves another tensor (a dropout in
    front of a token classifier saves its mask; under autocast the classifier saves a bf16 cast); and the token
    classifier's dropout output (``sequence_output``), the same size, where the classifier saves its cast instead
    (autocast). BERT's token classifier too (``BertForTokenClassification.forward``: ``outputs`` bound while the
    loss runs; it builds ``BertModel(config, add_pooling_layer=False)``): its last LayerNorm's output, which
    ``native_layer_norm``'s node does not save (it keeps the input, mean and rstd), in the residual stream's dtype
    (autocast runs ``layer_norm`` in fp32). 0 for LM heads and pooled (encoder) sequence heads, whose pooler's
    addmm saves the first token's view of that output (its whole storage: an activation), but under autocast, where it
    saves a bf16 copy of the first token's row (``BertForSequenceClassification.forward``: ``outputs`` bound)."""
    if model.head not in ("seq-cls", "token-cls"):
        return 0
    from trainmem.inventory import dtype_bytes

    d = step.dtypes
    hidden = step.batch * step.seq * model.hidden_size * dtype_bytes(d.compute)
    if model.head == "seq-cls" and head_layout(model).pooler:  # under autocast the pooler saves a (B, H) cast
        return hidden if d.autocast else 0
    dropped = model.head == "token-cls" and classifier_dropout(model) > 0.0
    return hidden * ((dropped or d.autocast) + (dropped and d.autocast))


#: a classifier's targets: the caller's labels, alive all step (not a block's shared input: phase_parts.py)
CALLER_LABELS = "labels"


# the forward --------------------------------------------------------------------------------------

def task_head(ctx, h: Sym) -> None:
    """A classification head and its loss on the base model's last hidden state ``h`` (B, S, H)."""
    if ctx.step.loss != "ce":
        from trainmem.errors import SpecError
        raise SpecError("loss", ctx.step.loss, f"chunked and fused losses are LM-head losses; a {ctx.model.head} "
                                               "head computes plain cross-entropy (--loss ce)")
    lay = head_layout(ctx.model)
    if ctx.model.head == "token-cls":
        _token_cls(ctx, h, lay)
    elif lay.pooler:
        _pooled_cls(ctx, h, lay)
    else:
        _last_token_cls(ctx, h, lay)


def _classifier(ctx, x: Sym, module: str, bias: bool) -> Sym:
    m = ctx.model
    with ctx.graph.module(module):
        return ctx.linear(x, m.num_labels, "nl", weight=(m.num_labels, m.hidden_size), bias=bias)


def _token_cls(ctx, h: Sym, lay: TaskHead) -> None:
    x = ctx.dropout(h, classifier_dropout(ctx.model), "dropout", module=True)
    logits = _classifier(ctx, x, lay.tok_module, lay.tok_bias)  # (B, S, nl)
    _cross_entropy(ctx, logits, (ctx.B * ctx.S, "B·S"), upcast=lay.tok_upcast)


def _last_token_cls(ctx, h: Sym, lay: TaskHead) -> None:
    g = ctx.graph
    logits = _classifier(ctx, h, lay.seq_module, lay.seq_bias)  # (B, S, nl)
    with g.module(lay.seq_module), g.module("pool"):  # after the classifier: a head item (names.is_head)
        # logits[arange(B), last_non_pad_token]: index's backward keeps the indices, not the logits
        g.save(g.new("batch_index", (ctx.B,), ("B",), "int64", False),
               g.new("last_non_pad_token", (ctx.B,), ("B",), "int64", False), when=logits.requires_grad)
        pooled = g.new("pooled_logits", (ctx.B, logits.shape[-1]), ("B", "nl"), logits.dtype, logits.requires_grad)
    _cross_entropy(ctx, pooled, (ctx.B, "B"), upcast=False)


def _pooled_cls(ctx, h: Sym, lay: TaskHead) -> None:
    """BERT: ``pooler.dense(hidden[:, 0])``, tanh, dropout, classifier."""
    g, m, B, H = ctx.graph, ctx.model, ctx.B, ctx.model.hidden_size
    with g.module(lay.pooler), g.module("dense"):
        wt = ctx.weight_trainable()
        if ctx.low:  # autocast copies the (B, H) view into a contiguous low-precision input
            g.save(g.new("input_cast", (B, H), ("B", "H"), ctx.low, h.requires_grad), when=wt)
            g.save(g.new("weight_cast", (H, H), ("H", "H"), ctx.low, wt), when=h.requires_grad)
        else:  # addmm keeps hidden[:, 0], a view: the whole (B, S, H) storage stays alive
            g.save(h, when=wt)
        dense = g.new("out", (B, H), ("B", "H"), ctx.low or h.dtype, h.requires_grad or wt, op="addmm")
    with g.module(lay.pooler), g.module("activation"):
        pooled = g.new("out", dense.shape, dense.dims, dense.dtype, dense.requires_grad)
        g.save(pooled, when=pooled.requires_grad)  # tanh keeps its output
    x = ctx.dropout(pooled, classifier_dropout(m), "dropout", module=True)
    logits = _classifier(ctx, x, lay.seq_module, lay.seq_bias)  # (B, nl)
    _cross_entropy(ctx, logits, (B, "B"), upcast=False)


def _cross_entropy(ctx, logits: Sym, rows: tuple[int, str], *, upcast: bool) -> None:
    """``F.cross_entropy`` = log_softmax (keeps its output) + nll_loss (keeps the targets and
    ``total_weight``, a 0-d tensor in the input's dtype: aten ``nll_loss_forward``). Autocast
    runs cross_entropy in fp32. The targets are the caller's ``labels`` viewed flat
    (``loss_utils.py`` ``ForSequenceClassificationLoss``/``ForTokenClassification``: ``labels.view(-1)``,
    no shifted copy as the LM loss makes), so they stay alive through the step: ``labels``, not a loss item."""
    g = ctx.graph
    n, sym = rows
    dtype = "float32" if upcast or ctx.low else logits.dtype
    target = g.new(CALLER_LABELS, (n,), (sym,), "int64", False)
    with g.module("loss"):
        g.save(g.new("log_softmax", (n, logits.shape[-1]), (sym, "nl"), dtype), when=logits.requires_grad)
        loss_value(g, dtype)  # nll_loss's output, before its total weight (estimate/loss_value.py)
        g.save(target, g.new("total_weight", (), (), dtype, False), when=logits.requires_grad)


def check_head(model: ModelSpec, impl, parallel=None, finetune=None) -> None:
    """Refuse what a classification head has not been modelled with, naming the field and value."""
    if model.head in ("lm", "mlm"):
        return
    from trainmem.errors import SpecError
    if finetune is not None and finetune.adapters:
        # peft trains the classifier through modules_to_save (task_type SEQ_CLS / TOKEN_CLS), its
        # all-linear adapts it (no output embeddings to exclude), and transformers' bitsandbytes
        # integration keeps only the last parameter's module in 16 bits (quantizers/base.py
        # get_keys_to_not_convert): none of that is modelled
        raise SpecError("head", model.head, f"LoRA/QLoRA on a {model.head} model is not modelled (peft's "
                                            "modules_to_save); use --finetune full with --freeze")
    if impl.profile != "hf":
        raise SpecError("profile", impl.profile, f"a {model.head} head is modelled under --profile hf only")
    if impl.compile:
        raise SpecError("compile", True, f"the compiled rules cover LM heads; a {model.head} head runs eager here")
    for name in ("tp", "cp", "pp"):
        value = getattr(parallel, name, 1) if parallel is not None else 1
        if value > 1:
            raise SpecError(name, value, f"a {model.head} head is modelled without tensor, context or "
                                         "pipeline parallelism (data parallel, ZeRO and FSDP are fine)")
