"""Gemma (``modeling_gemma.py``: RMSNorm times ``1 + w``, embeddings scaled by ``sqrt(H)``) and
Gemma-2 (``modeling_gemma2.py``: also sandwich norms and tanh soft-capping)."""

from __future__ import annotations

from trainmem.families.base import BlockRules, ConfigSchema, Family, register_family
from trainmem.families.buffers import gemma_buffers
from trainmem.families.config import ConfigReader
from trainmem.families.kinds import from_layer_types, pattern_types
from trainmem.families.llama import llama_family, llama_parameters


#: Gemma-2 and Gemma-3 read ``hidden_activation`` (not ``hidden_act``) and tanh soft-capping, null meaning off
GEMMA2_KEYS = dict(act_key="hidden_activation", off_when_null={"attn_softcap": "attn_logit_softcapping",
                                                              "logit_softcap": "final_logit_softcapping"})


def _read_gemma2(c: ConfigReader) -> dict:
    # layer_types, else Gemma2Config.__post_init__'s default: sliding, full, sliding, ...
    window = c("sliding_window")
    return {"layer_kinds": from_layer_types(c, pattern_types(c, 2), window=window) if window else ()}


@register_family
def gemma() -> Family:
    return llama_family("gemma", ConfigSchema(
        config_class="GemmaConfig",
        defaults={"vocab_size": 256000, "hidden_size": 3072, "intermediate_size": 24576, "num_hidden_layers": 28,
                  "num_attention_heads": 16, "num_key_value_heads": 16, "head_dim": 256,
                  "hidden_act": "gelu_pytorch_tanh", "tie_word_embeddings": True, "attention_bias": False,
                  "attention_dropout": 0.0}),
        rules=BlockRules(forward="llama", unit_offset_norm=True, scaled_embedding=True), buffers=gemma_buffers,
        compiled_rules=True, compiled_narrow=True)  # the Llama compiled block with a GELU-tanh gate (estimate/rules_compiled.py)


@register_family
def gemma2() -> Family:
    return llama_family("gemma2", ConfigSchema(
        config_class="Gemma2Config", read=_read_gemma2, **GEMMA2_KEYS,
        defaults={"vocab_size": 256000, "hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 26,
                  "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256,
                  "hidden_activation": "gelu_pytorch_tanh", "tie_word_embeddings": True, "attention_bias": False,
                  "attention_dropout": 0.0, "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0,
                  "sliding_window": 4096, "layer_types": None}),
        rules=BlockRules(forward="llama", unit_offset_norm=True, scaled_embedding=True, sandwich_norms=True),
        attentions=("eager", "flash"),  # Gemma2PreTrainedModel: _supports_sdpa = False (soft-capping)
        parameters=lambda m: llama_parameters(m, sandwich_norms=True), buffers=gemma_buffers,
        # the Gemma-3 compiled block without q/k norms, eager attention per block (estimate/rules_compiled_attention.py)
        compiled_rules=True, compiled_scopes=("block", "block-loss"))
