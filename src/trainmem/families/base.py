"""The family registry: what trainmem knows about one architecture, in one place.

A :class:`Family` holds everything that differs between code families (transformers'
``model_type``): how its ``config.json`` reads (:class:`ConfigSchema`), its parameters in
``named_parameters()`` order, which ``hf`` block rules run it (:class:`BlockRules`), how tensor
parallelism splits its linears (:class:`TPRoles`), and the module paths of its embeddings, blocks
and head. Each family module registers its families with :func:`register_family`, which refuses a
second family of the same name; everything else asks :func:`get_family`.

Module layouts that are not families -- the ``reference`` and ``megatron`` profiles name
modules their own way -- register a :class:`NameScheme` (:func:`register_scheme`), so that the
name queries (:func:`head_modules`, :func:`embedding_modules`, :func:`tp_roles`) cover every
item name an estimate can hold.

This module imports nothing from the estimator or the specs at run time (specs import it).

Layer kinds (the hook, not yet used): a family whose blocks are not all alike (DeepSeek-V3's
dense-then-MoE blocks, Gemma-3's local/global attention) sets :attr:`Family.layer_kinds`, a
function ``ModelSpec -> tuple[str, ...]`` giving each block's kind; the parameter layout and the
block rules then branch on the kind of block ``i`` instead of on the family. Today every family
leaves it ``None``: every block is alike.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

from trainmem.errors import SpecError
from trainmem.families.buffers import Buffer, rotary_buffers

if TYPE_CHECKING:  # pragma: no cover
    from trainmem.families.config import ConfigReader
    from trainmem.specs.model import ModelSpec

__all__ = ["Family", "ConfigSchema", "BlockRules", "TPRoles", "TaskHeads", "NameScheme", "register_family",
           "register_scheme", "get_family", "get_scheme", "family_names", "config_families", "families", "schemes",
           "head_modules", "embedding_modules", "token_embedding_modules", "tp_roles", "layer_containers",
           "default_attention", "family_attentions",
           "task_head_modules", "GENERIC_TASK_HEADS", "PEFT_VERSION"]

Params = list[tuple[str, tuple[int, ...]]]


@dataclass(frozen=True, kw_only=True)
class TPRoles:
    """How Megatron-style tensor parallelism splits a family's weights (by module name).

    A name in ``column`` splits its output features (``ColwiseParallel``), one in ``row`` its
    input features (``RowwiseParallel``); a ``vocab`` name is a vocabulary-parallel embedding or
    head (split over the vocabulary). Names are module names or dotted suffixes of module paths
    (``attention.dense``) as ``estimate/parallel_tp.py`` ``_tp_factor`` matches them.
    """

    column: tuple[str, ...] = ()
    row: tuple[str, ...] = ()
    vocab: tuple[str, ...] = ()
    kv: tuple[str, ...] = ()
    """The K and V projections among ``column``: serving (vLLM ``QKVParallelLinear``) keeps their
    heads per rank and replicates them when tp > KV heads (``estimate/inference_weights.py``)."""
    packed: tuple[str, ...] = ()
    """Column linears that pack several projections (GPT-2's ``c_attn``, Phi-3's ``qkv_proj``):
    serving weights per rank are not modelled for them."""


@dataclass(frozen=True)
class TaskHeads:
    """Where a family's transformers classes put their classification heads (``estimate/heads.py``)."""

    seq_module: str
    """The sequence classifier's linear (``score`` or ``classifier``)."""
    seq_bias: bool
    tok_module: str
    """The token classifier's linear."""
    tok_bias: bool
    tok_upcast: bool
    """The token-classification loss casts the logits to fp32 first (``ForTokenClassification``)."""
    pooler: str | None = None
    """BERT's pooler (first token, dense, tanh) in front of the sequence classifier; decoders pool
    the last token's logits instead."""


#: transformers' Generic*ForSequenceClassification (``score``, no bias) and
#: Generic*ForTokenClassification (``score`` with bias, ``ForTokenClassification`` upcasts):
#: ``transformers/modeling_layers.py``, the heads of every Llama-style family.
GENERIC_TASK_HEADS = TaskHeads("score", False, "score", True, True)

#: The peft release whose ``TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING``
#: (``peft/utils/constants.py``) the families' ``lora_targets`` follow.
PEFT_VERSION = "0.21.2"


@dataclass(frozen=True, kw_only=True)
class BlockRules:
    """Which ``hf`` block rules run a family (``estimate/rules_hf.py``) and its quirks there."""

    forward: str
    """The model forward of ``rules_hf``: ``llama`` (pre-norm RMSNorm decoder with RoPE),
    ``gpt`` (GPT-2 / GPT-NeoX LayerNorm decoder), ``bert`` (post-norm encoder), a family module's
    (``rules_hf._FORWARDS``: ``gpt_oss``, ``llama4``, ``mla`` for DeepSeek-V2/V3), or ``traced``: no
    hand-written rules (linear attention), ``--profile traced`` estimates it."""
    unit_offset_norm: bool = False
    """Gemma's RMSNorm: ``normed * (1 + w)`` in fp32, cast last (``GemmaRMSNorm``)."""
    scaled_embedding: bool = False
    """Gemma scales the token embedding by ``sqrt(H)`` (a new tensor)."""
    sandwich_norms: bool = False
    """Gemma-2: a norm after attention and two around the MLP (``pre_/post_feedforward_layernorm``)."""
    fused_qkv: bool = False
    """Phi-3: one ``qkv_proj``; its attention output is copied (``Phi3Attention``)."""
    fused_gate_up: bool = False
    """Phi-3: one ``gate_up_proj``, and the activation module is ``activation_fn``."""
    neox: bool = False
    """GPT-NeoX module names, rotary embeddings and fp32 softmax, rather than GPT-2's."""
    rope_per_layer_type: bool = False
    """Gemma-3: one cos/sin table per layer type (local blocks rotate with another base)."""
    post_norms: bool = False
    """OLMo-2: RMSNorm after attention and after the MLP, none before; q/k norms over the whole
    projection; ``Olmo2RMSNorm`` multiplies by ``w`` in fp32 and casts last."""
    rope_fp32: bool = False
    """OLMo-2: the rotary table stays fp32 (``Olmo2RotaryEmbedding``); q and k rotate in fp32 and
    are cast back (``apply_rotary_pos_emb``)."""
    router_cast: bool = False
    """Qwen3-MoE: the router casts its top-k weights back to the logits' dtype
    (``Qwen3MoeTopKRouter.forward``), so the experts keep them in that dtype, not fp32."""


@dataclass(frozen=True, kw_only=True)
class ConfigSchema:
    """How a Hugging Face ``config.json`` of this ``model_type`` reads (transformers 5.x)."""

    config_class: str
    """The transformers config class (named in messages)."""
    defaults: dict[str, Any]
    """The config class's defaults, for keys a file leaves out (only keys a ModelSpec reads)."""
    read: Callable[["ConfigReader"], dict] | None = None
    """The family's own fields beyond the declared ones (layer kinds, MoE, MLA): a
    :class:`~trainmem.families.config.ConfigReader` -> ModelSpec fields, merged last.
    :func:`~trainmem.families.config.read_fields` is the one reader that runs it."""
    aliases: dict[str, str] = field(default_factory=dict)
    """Keys the class also accepts under another name (``PretrainedConfig.attribute_map``)."""
    required: tuple[str, ...] = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                                 "intermediate_size")
    """Keys a file must write (or their alias): the sizes."""
    base: str = "llama"
    """The fields a style of config writes alike: ``llama`` (``LlamaConfig``'s keys, RMSNorm, a
    gated MLP, ``num_key_value_heads`` and ``head_dim``) or ``layernorm`` (BERT, GPT-NeoX, GPT-2:
    LayerNorm with biases, a two-matrix MLP, ``num_attention_heads`` heads)."""
    act_key: str = "hidden_act"
    """The ``ACT2FN`` name's key (Gemma-2/3: ``hidden_activation``; GPT-2: ``activation_function``)."""
    bias: str | bool = "attention_bias"
    """q/k/v and o projection biases: a key to read, or the class's constant."""
    keys: dict[str, str | None] = field(default_factory=dict)
    """ModelSpec field -> the config key it is copied from, over the base's (None: not read here,
    the family's ``read`` gives it)."""
    off_when_null: dict[str, str] = field(default_factory=dict)
    """ModelSpec float field -> a key whose null means off (0.0): Gemma's soft-capping."""
    fixed: dict[str, Any] = field(default_factory=dict)
    """ModelSpec fields every config of this class has (``qk_norm``, ``arch``)."""
    refuse: dict[str, str] = field(default_factory=dict)
    """Keys whose true value is not modelled -> why (checked before anything is read)."""


@dataclass(frozen=True, kw_only=True)
class NameScheme:
    """The module paths of one naming scheme, for the name queries below."""

    name: str
    embeddings: tuple[str, ...]
    """Input embedding module paths, the token embedding first."""
    head: tuple[str, ...]
    """Modules after the last block: final norm, output layer (the loss is ``loss`` everywhere)."""
    layers: str
    """The block container's path (``model.layers``): block ``i`` is ``{layers}.{i}``."""
    tp: TPRoles = TPRoles()
    parameters: Callable[["ModelSpec"], Params] | None = None
    """The scheme's own parameter layout, when its profile runs its own model (``reference``):
    then parameters and activations share one naming scheme. None: the family's layout."""
    buffers: Callable[["ModelSpec"], tuple[Buffer, ...]] | None = None
    """The scheme's own model buffers (``reference``: one ``inv_freq``); None: the family's."""


@dataclass(frozen=True, kw_only=True)
class Family(NameScheme):
    """One code family: a ``model_type`` of transformers, or ``generic`` (Llama names)."""

    config: ConfigSchema | None
    """How its ``config.json`` reads; None for a family no config names (``generic``)."""
    parameters: Callable[["ModelSpec"], Params]
    """``(name, shape)`` of every parameter, in ``named_parameters()`` order (LM head included)."""
    rules: BlockRules
    encoder: bool = False
    """Models ``arch="encoder"`` specs (BERT-style) too."""
    output_layer: str = "lm_head"
    """The module that maps the last hidden state to the vocabulary (never adapted or quantized)."""
    conv1d: bool = False
    """Linears are GPT-2's ``Conv1D`` (weight stored ``[in, out]``)."""
    layer_kinds: Callable[["ModelSpec"], tuple[str, ...]] | None = None
    """The hook for families whose blocks differ (see the module docstring); None: all alike."""
    task_heads: TaskHeads = GENERIC_TASK_HEADS
    """Its ``AutoModelFor{Sequence,Token}Classification`` heads (``--head seq-cls/token-cls``)."""
    encoder_task_heads: TaskHeads | None = None
    """The heads of its ``arch="encoder"`` specs when they differ (``generic``: BERT's)."""
    lora_targets: tuple[str, ...] = ("q_proj", "v_proj")
    """``--finetune lora`` without ``--lora-targets``: peft's default ``target_modules`` for this
    ``model_type`` (``peft/utils/constants.py`` ``TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING``,
    applied by ``LoraModel._prepare_adapter_config``), where :attr:`peft_default` says peft has one."""
    peft_default: bool = True
    """peft maps this ``model_type`` to :attr:`lora_targets`. False: peft has no entry and raises
    "Please specify ``target_modules``"; trainmem then adapts :attr:`lora_targets` (the attention's
    query and value projections, peft's usual pair) and says so in a note."""
    compiled_rules: bool = False
    """The estimator's compiled rules (``estimate/rules_compiled.py``) cover this family."""
    compiled_narrow: bool = False
    """Its compiled rules were checked at ``--recompute none`` (and full per block) in pure precisions
    only, without fine-tuning, Float8 or q/k/v biases (Phi-3, Gemma, Gemma-3, OLMo-2: docs/compile.md)."""
    compiled_scopes: tuple[str, ...] = ("model", "block", "block-loss")
    """The ``--compile-scope`` values its compiled rules were checked on (Gemma-3: per block only)."""
    attentions: tuple[str, ...] = ("sdpa", "eager", "flash", "sdpa-math", "mem-efficient")
    """The attention kernels (``ImplSpec.attention``) transformers runs this family with, its default
    first: ``--attention``'s default for the family (:func:`default_attention`). A model class with
    ``_supports_sdpa = False`` (gpt-oss's sinks, Gemma-2's soft-capping) starts with eager, as
    ``PreTrainedModel._check_and_adjust_attn_implementation`` falls back to eager for it."""
    fp32_params: tuple[str, ...] = ()
    """Its model class's ``_keep_in_fp32_modules_strict``: name fragments (``gate.weight``) whose
    parameters a 16-bit load keeps in fp32 (``models/hf.py`` ``_keep_strict_fp32``, as transformers'
    ``from_pretrained`` does); their gradients and optimizer states follow (``estimate/params.py``)."""
    buffers: Callable[["ModelSpec"], tuple[Buffer, ...]] = rotary_buffers
    """Its model's registered buffers (``named_buffers()``: rotary ``inv_freq``, BERT's position ids),
    resident all step: the estimate's ``buffer`` ledger (``families/buffers.py``, ``estimate/buffers.py``).
    Default: the Llama layout's one rotary module."""


_FAMILIES: dict[str, Family] = {}
_SCHEMES: dict[str, NameScheme] = {}


def _register(table: dict, item: NameScheme, what: str) -> None:
    if item.name in _FAMILIES or item.name in _SCHEMES:
        raise SpecError(what, item.name, "is already registered (a family or naming scheme is defined once)")
    table[item.name] = item
    _clear()


def register_family(make: Callable[[], Family]) -> Callable[[], Family]:
    """Decorator: register the :class:`Family` the function returns; a name registered twice raises."""
    _register(_FAMILIES, make(), "family")
    return make


def register_scheme(make: Callable[[], NameScheme]) -> Callable[[], NameScheme]:
    """Decorator: register a profile's :class:`NameScheme`; a name registered twice raises."""
    _register(_SCHEMES, make(), "scheme")
    return make


def get_family(name: str) -> Family:
    """The registered family ``name``; :class:`SpecError` naming the known ones otherwise."""
    try:
        return _FAMILIES[name]
    except (KeyError, TypeError):
        raise SpecError("family", name, f"must be one of {', '.join(_FAMILIES)}") from None


def get_scheme(name: str) -> NameScheme | None:
    """The naming scheme a profile registered (``reference``, ``megatron``), else None."""
    return _SCHEMES.get(name)


def family_attentions(name: str) -> tuple[str, ...]:
    """The attention kernels a model of family ``name`` runs (:attr:`Family.attentions`; every kernel
    for a name no family registers, ``sdpa`` first: transformers' default)."""
    family = _FAMILIES.get(name)
    return family.attentions if family else Family.attentions


def default_attention(name: str) -> str:
    """The attention kernel a model of family ``name`` runs when none is asked for."""
    return family_attentions(name)[0]


def family_names() -> tuple[str, ...]:
    """Every registered family, in registration order."""
    return tuple(_FAMILIES)


def families() -> tuple[Family, ...]:
    return tuple(_FAMILIES.values())


def schemes() -> tuple[NameScheme, ...]:
    """Every naming scheme: the families', then the profiles'."""
    return (*_FAMILIES.values(), *_SCHEMES.values())


def config_families() -> dict[str, Family]:
    """``model_type`` -> family, for the families a ``config.json`` can name."""
    return {n: f for n, f in _FAMILIES.items() if f.config is not None}


# name queries over every scheme: memoized, forgotten when a family registers -----------------------
_CACHE: dict[str, Any] = {}


def _clear() -> None:
    _CACHE.clear()


def _union(key: str, pick: Callable[[NameScheme], tuple[str, ...]]) -> tuple[str, ...]:
    if key not in _CACHE:
        out: dict[str, None] = {}
        for s in schemes():
            out.update(dict.fromkeys(pick(s)))
        _CACHE[key] = tuple(out)
    return _CACHE[key]


def head_modules() -> tuple[str, ...]:
    """Module paths after the last block in any scheme (final norms, output layers), ``loss``, and the
    classification heads' modules (``task_head_parts``): all of them run, and free, before the blocks' backward."""
    return _union("head", lambda s: (*s.head, "loss", *task_head_parts(s)))


#: a classification model's top-level dropout in front of its classifier (transformers'
#: ``*ForTokenClassification.dropout``, ``BertForSequenceClassification.dropout``)
CLASSIFIER_DROPOUT = "dropout"


def _task_heads(s: NameScheme) -> list[TaskHeads]:
    return [h for h in (getattr(s, "task_heads", None), getattr(s, "encoder_task_heads", None)) if h]


def task_head_parts(s: NameScheme) -> tuple[str, ...]:
    """A scheme's classification-head modules: its classifiers, BERT's pooler, the dropout before them."""
    return tuple(dict.fromkeys(m for h in _task_heads(s) for m in (h.seq_module, h.tok_module,
                                                                   *filter(None, (h.pooler,)), CLASSIFIER_DROPOUT)))


def output_modules() -> tuple[str, ...]:
    """What runs after the final norm, by first module name: every output layer (``lm_head``, BERT's
    ``cls``), ``loss``, and the task heads (``score``, ``classifier``)."""
    outputs = _union("output", lambda s: (*((s.output_layer.split(".")[0],) if hasattr(s, "output_layer") else ()),
                                          "loss"))
    return outputs + tuple(m for m in task_head_modules() if m not in outputs)


def embedding_modules() -> tuple[str, ...]:
    """Input embedding module paths in any scheme (token, position, token-type)."""
    return _union("embeddings", lambda s: s.embeddings)


def token_embedding_modules() -> tuple[str, ...]:
    """The token embedding of each scheme (``get_input_embeddings()``)."""
    return _union("token", lambda s: s.embeddings[:1])


def layer_containers() -> tuple[str, ...]:
    """The last component of each scheme's block container (``layers``, ``h``, ``layer``)."""
    return _union("layers", lambda s: (s.layers.rpartition(".")[2],))


def task_head_modules() -> tuple[str, ...]:
    """Every family's classification-head linears (``score``, ``classifier``)."""
    return _union("task", lambda s: tuple(m for h in _task_heads(s) for m in (h.seq_module, h.tok_module)))


def tp_roles() -> TPRoles:
    """The union of every scheme's tensor-parallel roles."""
    if "tp" not in _CACHE:
        _CACHE["tp"] = TPRoles(column=_union("col", lambda s: s.tp.column), row=_union("row", lambda s: s.tp.row),
                               vocab=_union("vocab", lambda s: s.tp.vocab))
    return _CACHE["tp"]
