"""Mistral (``modeling_mistral.py``): the Llama layout, no attention bias key."""

from __future__ import annotations

from trainmem.families.base import ConfigSchema, Family, register_family
from trainmem.families.config import ConfigReader
from trainmem.families.kinds import uniform_window
from trainmem.families.llama import llama_family

__all__ = ["MISTRAL_DEFAULTS"]

#: MistralConfig's defaults (MixtralConfig shares them for these keys).
MISTRAL_DEFAULTS = {
    "vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
    "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": None, "hidden_act": "silu",
    "tie_word_embeddings": False, "attention_dropout": 0.0,
}


def _read(c: ConfigReader) -> dict:
    return {"layer_kinds": uniform_window(c)}


@register_family
def mistral() -> Family:
    # MistralConfig's sliding_window defaults to 4096 (MixtralConfig's to None)
    # compiled_rules: those of Llama while the window is not shorter than S (estimate/rules_compiled.py)
    return llama_family("mistral", compiled_rules=True,
                        config=ConfigSchema(config_class="MistralConfig", read=_read, bias=False,
                                            defaults={**MISTRAL_DEFAULTS, "sliding_window": 4096}))
