"""Gemma-3 text (``modeling_gemma3.py``, ``model_type`` ``gemma3_text``): Gemma-2's block (``1 + w``
RMSNorms, scaled embedding, sandwich norms) with per-head q/k norms, local (sliding-window) and
global blocks from ``layer_types`` (default: five local, one global; ``sliding_window_pattern``),
and one rotary table per layer type (``Gemma3RotaryEmbedding``: the local base differs)."""

from __future__ import annotations

from trainmem.errors import UnsupportedError
from trainmem.families.base import BlockRules, ConfigSchema, Family, register_family
from trainmem.families.buffers import gemma3_buffers
from trainmem.families.config import ConfigReader
from trainmem.families.gemma import GEMMA2_KEYS
from trainmem.families.kinds import from_layer_types, pattern_types
from trainmem.families.llama import llama_family, llama_parameters


def _read(c: ConfigReader) -> dict:
    types = pattern_types(c, c("sliding_window_pattern"))  # Gemma3TextConfig.__post_init__
    window = c("sliding_window")
    if window is None and "sliding_attention" in types:
        raise UnsupportedError(f"{c.model_type} sliding_window=None with sliding_attention layers")
    return {"layer_kinds": from_layer_types(c, types, window=window)}


@register_family
def gemma3_text() -> Family:
    return llama_family("gemma3_text", ConfigSchema(
        config_class="Gemma3TextConfig", read=_read, **GEMMA2_KEYS, fixed={"qk_norm": True},
        refuse={"use_bidirectional_attention": "bidirectional attention is not modelled"},
        defaults={"vocab_size": 262208, "hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 26,
                  "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256,
                  "hidden_activation": "gelu_pytorch_tanh", "tie_word_embeddings": True, "attention_bias": False,
                  "attention_dropout": 0.0, "attn_logit_softcapping": None, "final_logit_softcapping": None,
                  "sliding_window": 4096, "sliding_window_pattern": 6, "layer_types": None,
                  "use_bidirectional_attention": None}),
        rules=BlockRules(forward="llama", unit_offset_norm=True, scaled_embedding=True, sandwich_norms=True,
                         rope_per_layer_type=True),
        parameters=lambda m: llama_parameters(m, sandwich_norms=True), buffers=gemma3_buffers,
        # the Llama compiled block with q/k and sandwich norms (estimate/rules_compiled.py); whole-model compile keeps
        # each block's residual sum too (traced), not modelled
        compiled_rules=True, compiled_narrow=True, compiled_scopes=("block", "block-loss"))
