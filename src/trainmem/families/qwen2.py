"""Qwen2 (``modeling_qwen2.py``: q, k, v carry a bias, o_proj does not) and Qwen3
(``modeling_qwen3.py``: per-head RMSNorm on q and k)."""

from __future__ import annotations

from trainmem.families.base import ConfigSchema, Family, register_family
from trainmem.families.kinds import qwen_windows
from trainmem.families.llama import llama_family

_QWEN2_DEFAULTS = {  # Qwen2Config
    "vocab_size": 151936, "hidden_size": 4096, "intermediate_size": 22016, "num_hidden_layers": 32,
    "num_attention_heads": 32, "num_key_value_heads": 32, "head_dim": None, "hidden_act": "silu",
    "tie_word_embeddings": False, "attention_dropout": 0.0,
    "use_sliding_window": False, "sliding_window": 4096, "max_window_layers": 28, "layer_types": None,
}


def _windows(c) -> dict:
    return {"layer_kinds": qwen_windows(c)}


@register_family
def qwen2() -> Family:
    # q, k, v carry a bias; o_proj does not
    return llama_family("qwen2", compiled_rules=True,
                        config=ConfigSchema(config_class="Qwen2Config", defaults=_QWEN2_DEFAULTS, read=_windows,
                                            bias=False, fixed={"qkv_bias": True}))


@register_family
def qwen3() -> Family:
    # Qwen3Config shares Qwen2Config's defaults for these keys
    return llama_family("qwen3", compiled_rules=True,
                        config=ConfigSchema(config_class="Qwen3Config", read=_windows, fixed={"qk_norm": True},
                                            defaults={**_QWEN2_DEFAULTS, "head_dim": 128, "attention_bias": False}))
