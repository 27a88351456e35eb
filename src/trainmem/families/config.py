"""Reading a Hugging Face ``config.json`` the way its transformers config class reads it.

Each family's :class:`~trainmem.families.base.ConfigSchema` names its defaults and aliases; its
reader gets a :class:`ConfigReader` and returns ModelSpec fields.
"""

from __future__ import annotations

from typing import Any, Mapping

from trainmem.errors import UnsupportedError
from trainmem.families.base import ConfigSchema

__all__ = ["ConfigReader", "llama_like"]

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


def llama_like(c: ConfigReader, *, act_key: str = "hidden_act", bias_key: str | None = "attention_bias") -> dict:
    """The fields every Llama-like config writes the same way (``LlamaConfig`` and its relatives)."""
    attention_bias = c(bias_key) if bias_key else False
    return {
        "hidden_size": c("hidden_size"),
        "num_layers": c("num_hidden_layers"),
        **_heads(c),
        "ffn_size": c("intermediate_size"),
        "activation": c.activation(act_key, gated=True),
        "norm": "rmsnorm",
        "qkv_bias": attention_bias,
        "out_bias": attention_bias,
        "tied_embeddings": c("tie_word_embeddings"),
        "vocab_size": c("vocab_size"),
        "attn_dropout": c("attention_dropout"),
    }
