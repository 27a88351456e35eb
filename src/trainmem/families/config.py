"""Reading a Hugging Face ``config.json`` the way its transformers config class reads it.

Each family's :class:`~trainmem.families.base.ConfigSchema` DECLARES how its file reads: defaults,
aliases, required sizes, the base style (``llama`` or ``layernorm``), the keys copied into ModelSpec
fields, constants, and keys it refuses. :func:`read_fields` is the one reader that consumes those
declarations; a family's ``read`` adds only what no table can say (layer kinds, MoE, MLA).
"""

from __future__ import annotations

from typing import Any, Mapping

from trainmem.errors import UnsupportedError
from trainmem.families.base import ConfigSchema

__all__ = ["ConfigReader", "read_fields", "llama_like", "MOE_KEYS"]

#: ``ACT2FN`` names -> trainmem activation for a two-matrix MLP.
_PLAIN_ACTIVATIONS = {
    "gelu": "gelu", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu_fast": "gelu_tanh",
    "relu": "relu",
}
#: ``ACT2FN`` names -> trainmem activation for a gated MLP (act(gate) * up).
_GATED_ACTIVATIONS = {
    "silu": "swiglu", "swish": "swiglu", "gelu": "geglu", "gelu_new": "geglu",
    "gelu_pytorch_tanh": "geglu", "gelu_fast": "geglu",
}


class ConfigReader:
    """A config dict read the way its transformers config class reads it."""

    def __init__(self, cfg: Mapping[str, Any], model_type: str, schema: ConfigSchema) -> None:
        self.cfg = cfg
        self.model_type = model_type
        self.schema = schema
        self.defaults = schema.defaults
        self.aliases = schema.aliases

    def __call__(self, key: str) -> Any:
        if key in self.cfg:
            return self.cfg[key]
        alias = self.aliases.get(key)
        if alias is not None and alias in self.cfg:
            return self.cfg[alias]
        return self.defaults[key]

    def activation(self, key: str, *, gated: bool) -> str:
        value = self(key)
        table = _GATED_ACTIVATIONS if gated else _PLAIN_ACTIVATIONS
        if not isinstance(value, str) or value not in table:
            kind = "gated" if gated else "two-matrix"
            raise UnsupportedError(
                f"{self.model_type} {key}={value!r} is not modelled for a {kind} MLP "
                f"(supported: {', '.join(table)})"
            )
        return table[value]

    def refuse_if(self, key: str, why: str) -> None:
        if self(key):
            raise UnsupportedError(f"{self.model_type} {key}={self(key)!r}: {why}")


#: The keys a base style copies into ModelSpec fields (a family's ``keys`` override them).
_BASE_KEYS: dict[str, dict[str, str]] = {
    "llama": {"hidden_size": "hidden_size", "num_layers": "num_hidden_layers", "ffn_size": "intermediate_size",
              "tied_embeddings": "tie_word_embeddings", "vocab_size": "vocab_size",
              "attn_dropout": "attention_dropout"},
    "layernorm": {"hidden_size": "hidden_size", "num_layers": "num_hidden_layers",
                  "num_heads": "num_attention_heads", "ffn_size": "intermediate_size",
                  "tied_embeddings": "tie_word_embeddings", "vocab_size": "vocab_size"},
}
#: What a base style always is: LlamaRMSNorm and a gated MLP; or nn.LayerNorm and nn.Linear, all with biases
_BASE_FIXED: dict[str, dict[str, Any]] = {
    "llama": {"norm": "rmsnorm"},
    "layernorm": {"norm": "layernorm", "mlp_bias": True, "norm_bias": True},
}

#: The MoE keys of Mixtral-style configs (MixtralConfig, GptOssConfig, Llama4TextConfig): routed
#: experts, top-k, and each expert's width under ``intermediate_size``.
MOE_KEYS = {"num_experts": "num_local_experts", "top_k": "num_experts_per_tok", "expert_ffn_size": "intermediate_size"}


def _heads(c: ConfigReader) -> dict[str, Any]:
    """Head counts as the Llama-style attention modules read them; ``None`` means "derive"."""
    heads = c("num_attention_heads")
    kv = c("num_key_value_heads")
    return {
        "num_heads": heads,
        "num_kv_heads": heads if kv is None else kv,
        # every Llama-like family takes config.head_dim when set, else hidden_size // num_attention_heads
        "head_dim": c("head_dim") or None,
    }


def _base(c: ConfigReader, base: str, act_key: str, bias: str | bool, keys: Mapping[str, str | None]) -> dict:
    out = {f: c(k) for f, k in {**_BASE_KEYS[base], **keys}.items() if k is not None}
    if base == "llama":
        out.update(_heads(c))
    out["activation"] = c.activation(act_key, gated=base == "llama")
    value = c(bias) if isinstance(bias, str) else bias
    return {**out, "qkv_bias": value, "out_bias": value, **_BASE_FIXED[base]}


def read_fields(c: ConfigReader) -> dict:
    """ModelSpec fields from a config file, as its family's :class:`ConfigSchema` declares them."""
    s = c.schema
    for key, why in s.refuse.items():
        c.refuse_if(key, why)
    out = _base(c, s.base, s.act_key, s.bias, s.keys)
    out.update({f: float(c(k) or 0.0) for f, k in s.off_when_null.items()})
    out.update(s.fixed)
    if s.read is not None:
        out.update(s.read(c))
    return out


def llama_like(c: ConfigReader, *, act_key: str = "hidden_act", bias_key: str | None = "attention_bias") -> dict:
    """The fields every Llama-like config writes the same way (``LlamaConfig`` and its relatives)."""
    return _base(c, "llama", act_key, bias_key or False, {})
