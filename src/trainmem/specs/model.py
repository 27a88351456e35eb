"""ModelSpec: the shape of a Transformer, enough to count every parameter and saved tensor."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Literal

from trainmem.errors import SpecError
from trainmem.families import family_names, get_family
from trainmem import validate as v
from trainmem.specs.layer_kind import LayerKind, as_layer_kind, fit_kinds

__all__ = ["ModelSpec", "LayerKind", "FAMILIES", "ACTIVATIONS", "NORMS", "HEADS"]

#: Code families whose module structure (and so saved set) the ``hf`` profile knows: the
#: registered ones (``trainmem/families/``, one module each).
FAMILIES = family_names()
MAX_LAYERS = 10_000  # the deepest published models have ~100-200 blocks; more is a typo
ACTIVATIONS = ("gelu", "gelu_tanh", "relu", "swiglu", "geglu")
NORMS = ("layernorm", "rmsnorm")
#: Task heads (transformers' Auto classes: ForCausalLM, ForMaskedLM, ForSequenceClassification,
#: ForTokenClassification); their rules are in ``estimate/heads.py``.
HEADS = ("lm", "mlm", "seq-cls", "token-cls")


@dataclass(frozen=True, kw_only=True)
class ModelSpec:
    """A decoder-only or encoder-only Transformer."""

    name: str = "custom"
    """Display name (preset name or config path)."""
    family: str = "generic"
    """Code family (``llama``, ``gpt2``, ...): decides module names and the ``hf`` saved set."""
    arch: Literal["decoder", "encoder"] = "decoder"
    """``decoder`` (causal LM head) or ``encoder`` (BERT-style masked-LM head)."""
    hidden_size: int
    """Model width H."""
    num_layers: int
    """Number of Transformer blocks L."""
    num_heads: int
    """Query heads A."""
    num_kv_heads: int | None = None
    """Key/value heads (GQA/MQA); defaults to ``num_heads``."""
    head_dim: int | None = None
    """Per-head width; defaults to ``hidden_size // num_heads``."""
    ffn_size: int
    """FFN intermediate width F (per branch for gated activations)."""
    activation: str = "swiglu"
    """``gelu``, ``gelu_tanh``, ``relu`` (two-matrix MLP) or ``swiglu``, ``geglu`` (gated, three matrices)."""
    norm: str = "rmsnorm"
    """``layernorm`` or ``rmsnorm``."""
    qkv_bias: bool = False
    """Bias on the Q, K, V projections."""
    out_bias: bool = False
    """Bias on the attention output projection."""
    mlp_bias: bool = False
    """Bias on the MLP projections."""
    norm_bias: bool = False
    """LayerNorm has a bias (ignored for RMSNorm)."""
    qk_norm: bool = False
    """Per-head RMSNorm on Q and K (Qwen3)."""
    tied_embeddings: bool = False
    """LM head shares the token embedding matrix."""
    vocab_size: int
    """Vocabulary size V."""
    max_positions: int = 0
    """Rows of a learned position embedding; 0 for rotary (no position parameters)."""
    type_vocab_size: int = 0
    """Token-type embedding rows (BERT)."""
    attn_dropout: float = 0.0
    """Dropout on attention probabilities."""
    hidden_dropout: float = 0.0
    """Dropout on each residual branch output."""
    embd_dropout: float = 0.0
    """Dropout on the embedding output."""
    rotary_dim: int = 0
    """Per-head dims that RoPE rotates (GPT-NeoX ``rotary_pct``); 0 means the whole head."""
    attn_softcap: float = 0.0
    """tanh soft-capping of attention scores (Gemma-2); 0 for none."""
    logit_softcap: float = 0.0
    """tanh soft-capping of the final logits (Gemma-2); 0 for none."""
    parallel_residual: bool = False
    """Attention and MLP read the same input and add into the residual together (GPT-J/NeoX)."""
    num_experts: int = 0
    """Routed experts per MoE layer; 0 for a dense MLP."""
    top_k: int = 0
    """Experts each token is routed to."""
    expert_ffn_size: int = 0
    """Intermediate width of one expert; defaults to ``ffn_size``."""
    num_shared_experts: int = 0
    """Always-on experts next to the routed ones."""
    head: str | None = None
    """Task head: ``lm`` (causal LM), ``mlm`` (BERT's masked-LM head), ``seq-cls`` (one label per
    sequence), ``token-cls`` (one label per token); default: lm for decoders, mlm for encoders."""
    num_labels: int = 2
    """Classes of a ``seq-cls``/``token-cls`` head (transformers' ``num_labels``)."""
    classifier_dropout: float | None = None
    """Dropout before a classification head (``classifier_dropout``); None: transformers' default
    for the family (BERT: ``hidden_dropout``, decoders' token classifiers: 0.1)."""
    layer_kinds: tuple[LayerKind, ...] = ()
    """One :class:`LayerKind` per block where blocks differ (attention full/sliding/chunked/linear
    with its window, RoPE or not, dense or MoE MLP); empty: every block is :attr:`default_kind`.
    A list of another length is cut to ``num_layers`` or grown by its last period (``fit_kinds``)."""
    q_lora_rank: int = 0
    """MLA (DeepSeek-V2/V3): rank of the query's low-rank down-projection; 0: a full ``q_proj``."""
    kv_lora_rank: int = 0
    """MLA: rank of the joint key/value down-projection; 0: not MLA."""
    qk_nope_head_dim: int = 0
    """MLA: per-head query/key dims without RoPE."""
    qk_rope_head_dim: int = 0
    """MLA: per-head query/key dims with RoPE (the key's are shared by all heads)."""
    v_head_dim: int = 0
    """MLA: per-head value dims (``head_dim`` is then the q/k head: nope + rope)."""
    attn_sinks: bool = False
    """A learned per-head sink logit joins each softmax (gpt-oss ``self_attn.sinks``)."""
    attn_temperature_tuning: bool = False
    """Llama-4's NoPE blocks scale q by ``log1p(floor((pos + 1) / floor_scale)) * attn_scale + 1``
    (``attn_temperature_tuning``)."""
    router_norm_topk: bool = True
    """The router renormalizes its top-k weights to sum to 1 (Qwen3-MoE's ``norm_topk_prob``;
    Mixtral always does)."""
    router_aux_loss: bool = False
    """The step adds the routers' load-balancing loss (transformers' ``output_router_logits``,
    ``load_balancing_loss_func``): it keeps each MoE block's softmax of the router logits until backward."""
    router_group_mask: bool = False
    """The router masks the scores it picks the top-k weights from to the best expert groups
    (DeepSeek-V2's ``topk_method="group_limited_greedy"``): autograd keeps that (B·S, E) mask."""
    shared_expert_ffn_size: int = 0
    """Width of the shared-expert MLP when it is not ``num_shared_experts * expert_ffn_size``
    (qwen3_next's ``shared_expert_intermediate_size``); 0: that product."""
    linear_num_key_heads: int = 0
    """Linear-attention (gated DeltaNet, qwen3_next) key heads; 0 without linear-attention blocks."""
    linear_num_value_heads: int = 0
    """Linear-attention value heads."""
    linear_key_head_dim: int = 0
    """Linear-attention per-head key dims."""
    linear_value_head_dim: int = 0
    """Linear-attention per-head value dims."""
    linear_conv_kernel: int = 0
    """Linear-attention short depthwise convolution's kernel width."""

    def __post_init__(self) -> None:
        v.one_of("family", self.family, family_names())  # the registry now, with families added since import
        v.one_of("arch", self.arch, ("decoder", "encoder"))
        for name in ("hidden_size", "num_heads", "ffn_size", "vocab_size"):
            v.positive(name, getattr(self, name))
        v.positive("num_layers", self.num_layers, maximum=MAX_LAYERS)
        if self.num_kv_heads is None:
            object.__setattr__(self, "num_kv_heads", self.num_heads)
        v.positive("num_kv_heads", self.num_kv_heads)
        if self.head_dim is None:
            if self.hidden_size % self.num_heads:
                raise SpecError(
                    "num_heads", self.num_heads,
                    f"does not divide hidden_size={self.hidden_size} (set head_dim explicitly)",
                )
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_heads)
        v.positive("head_dim", self.head_dim)
        if self.num_heads % self.num_kv_heads:
            raise SpecError(
                "num_kv_heads", self.num_kv_heads,
                f"must divide num_heads={self.num_heads}",
            )
        v.one_of("activation", self.activation, ACTIVATIONS)
        v.one_of("norm", self.norm, NORMS)
        for name in ("qkv_bias", "out_bias", "mlp_bias", "norm_bias", "qk_norm",
                     "tied_embeddings", "parallel_residual"):
            v.boolean(name, getattr(self, name))
        for name in ("max_positions", "type_vocab_size", "num_experts", "top_k",
                     "expert_ffn_size", "num_shared_experts"):
            v.non_negative(name, getattr(self, name))
        for name in ("attn_dropout", "hidden_dropout", "embd_dropout"):
            v.probability(name, getattr(self, name))
        for name in ("attn_softcap", "logit_softcap"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
                raise SpecError(name, value, "must be a non-negative number (0 disables)")
        v.non_negative("rotary_dim", self.rotary_dim)
        if self.rotary_dim > self.head_dim:
            raise SpecError("rotary_dim", self.rotary_dim, f"exceeds head_dim={self.head_dim}")
        if self.num_experts:
            if not 1 <= self.top_k <= self.num_experts:
                raise SpecError(
                    "top_k", self.top_k,
                    f"must be between 1 and num_experts={self.num_experts}",
                )
            if not self.expert_ffn_size:
                object.__setattr__(self, "expert_ffn_size", self.ffn_size)
        elif self.top_k or self.num_shared_experts:
            raise SpecError("num_experts", 0, f"is required when top_k={self.top_k} "
                            f"or num_shared_experts={self.num_shared_experts} is set")
        if self.arch == "encoder" and not get_family(self.family).encoder:
            raise SpecError("arch", self.arch, f"encoder models are modelled for family bert, not {self.family}")
        if self.head is None:
            object.__setattr__(self, "head", "mlm" if self.arch == "encoder" else "lm")
        v.one_of("head", self.head, HEADS)
        if (self.head, self.arch) in (("lm", "encoder"), ("mlm", "decoder")):
            article = "an" if self.arch == "encoder" else "a"
            raise SpecError("head", self.head, f"is not a head of {article} {self.arch} model "
                                               f"(use {'mlm' if self.arch == 'encoder' else 'lm'}, seq-cls or token-cls)")
        v.positive("num_labels", self.num_labels, maximum=1 << 20)
        if self.classifier_dropout is not None:
            v.probability("classifier_dropout", self.classifier_dropout)
        self._check_kinds()

    def _check_kinds(self) -> None:
        for name in ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
                     "shared_expert_ffn_size", "linear_num_key_heads", "linear_num_value_heads",
                     "linear_key_head_dim", "linear_value_head_dim", "linear_conv_kernel"):
            v.non_negative(name, getattr(self, name))
        if self.kv_lora_rank and self.head_dim != self.qk_nope_head_dim + self.qk_rope_head_dim:
            raise SpecError("head_dim", self.head_dim, f"must be qk_nope_head_dim + qk_rope_head_dim = "
                                                       f"{self.qk_nope_head_dim + self.qk_rope_head_dim} under MLA")
        v.boolean("attn_sinks", self.attn_sinks)
        v.boolean("attn_temperature_tuning", self.attn_temperature_tuning)
        v.boolean("router_norm_topk", self.router_norm_topk)
        v.boolean("router_aux_loss", self.router_aux_loss)
        v.boolean("router_group_mask", self.router_group_mask)
        if isinstance(self.layer_kinds, (str, bytes)) or not isinstance(self.layer_kinds, (tuple, list)):
            raise SpecError("layer_kinds", self.layer_kinds, "must be a list of layer kinds, one per block")
        # a spec cut or grown with replace(num_layers=...) keeps its pattern (fit_kinds)
        kinds = fit_kinds(tuple(as_layer_kind(k) for k in self.layer_kinds), self.num_layers)
        object.__setattr__(self, "layer_kinds", kinds)
        if any(k.mlp == "moe" for k in kinds) and not self.is_moe:
            raise SpecError("layer_kinds", "moe", "needs num_experts > 0")
        if any(k.attention == "linear" for k in kinds) and not (self.linear_num_key_heads and self.linear_num_value_heads
                                                               and self.linear_key_head_dim and self.linear_value_head_dim
                                                               and self.linear_conv_kernel):
            raise SpecError("layer_kinds", "linear", "needs the linear-attention sizes (linear_num_key_heads, "
                                                     "linear_num_value_heads, linear_key_head_dim, linear_value_head_dim, "
                                                     "linear_conv_kernel)")
        if self.shared_expert_ffn_size and not self.num_shared_experts:
            raise SpecError("shared_expert_ffn_size", self.shared_expert_ffn_size, "needs num_shared_experts > 0")

    # derived sizes ---------------------------------------------------------
    @property
    def gated(self) -> bool:
        return self.activation in ("swiglu", "geglu")

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def shared_ffn_size(self) -> int:
        """Width of the shared-expert MLP (0 without one)."""
        return self.shared_expert_ffn_size or self.num_shared_experts * self.expert_ffn_size

    @property
    def default_kind(self) -> LayerKind:
        """The kind of every block when :attr:`layer_kinds` is empty: full attention, the spec's MLP."""
        return LayerKind(mlp="moe" if self.is_moe else "dense")

    @property
    def kinds(self) -> tuple[LayerKind, ...]:
        """One kind per block (:attr:`layer_kinds`, or :attr:`default_kind` for each)."""
        return self.layer_kinds or (self.default_kind,) * self.num_layers

    def kind(self, i: int) -> LayerKind:
        """The kind of block ``i``."""
        return self.layer_kinds[i] if self.layer_kinds else self.default_kind

    @property
    def uniform(self) -> bool:
        """Every block is of one kind."""
        return len(set(self.layer_kinds)) <= 1

    def to_dict(self) -> dict:
        d = {f.name: getattr(self, f.name) for f in fields(self)}
        d["layer_kinds"] = [k.to_dict() for k in self.layer_kinds]
        return d

    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in fields(cls))
