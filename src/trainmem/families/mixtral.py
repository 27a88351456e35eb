"""Mixtral (``modeling_mixtral.py``): Mistral with a sparse MoE MLP (router ``gate``, experts as
fused 3-D ``experts.gate_up_proj`` / ``experts.down_proj``, transformers 5.x)."""

from __future__ import annotations

from trainmem.families.base import ConfigSchema, Family, register_family
from trainmem.families.config import MOE_KEYS, ConfigReader
from trainmem.families.kinds import uniform_window
from trainmem.families.llama import llama_family
from trainmem.families.mistral import MISTRAL_DEFAULTS
from trainmem.families.moe_layout import router_aux_loss

_SIZES = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size")


def _read(c: ConfigReader) -> dict:
    return {"layer_kinds": tuple({**k, "mlp": "moe"} for k in uniform_window(c)), "router_aux_loss": router_aux_loss(c)}


@register_family
def mixtral() -> Family:
    # compiled_rules: the Llama block with estimate/rules_compiled_moe.py's MLP
    return llama_family("mixtral", compiled_rules=True, config=ConfigSchema(
        config_class="MixtralConfig", read=_read, bias=False, keys=MOE_KEYS,
        defaults={**MISTRAL_DEFAULTS, "num_experts_per_tok": 2, "num_local_experts": 8, "sliding_window": None,
                  "output_router_logits": False},
        aliases={"num_local_experts": "num_experts"},
        required=(*_SIZES, "num_local_experts", "num_experts_per_tok")))
