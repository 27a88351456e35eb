"""Llama-4 text (``modeling_llama4.py``, ``model_type`` ``llama4_text``): dense blocks
(``intermediate_size_mlp``) interleaved with MoE blocks (``moe_layers``, default every
``interleave_moe_layer_step``-th: routed experts as fused ``(E, H, 2F)`` tensors, a ``router``, one
shared expert), chunked attention on RoPE blocks and global NoPE blocks (``no_rope_layers``). The
``hf`` profile's rules for them are in ``estimate/rules_llama4.py``."""

from __future__ import annotations

from typing import TYPE_CHECKING

from trainmem.families import layout as lay
from trainmem.families.base import BlockRules, ConfigSchema, Family, register_family
from trainmem.families.config import MOE_KEYS, ConfigReader
from trainmem.families.kinds import from_layer_types
from trainmem.families.llama import LLAMA_NAMES
from trainmem.families.moe_layout import attention, dense_mlp, experts, kind_blocks

if TYPE_CHECKING:  # pragma: no cover
    from trainmem.specs.layer_kind import LayerKind
    from trainmem.specs.model import ModelSpec


def _read(c: ConfigReader) -> dict:
    L = c("num_hidden_layers")
    # Llama4TextConfig.__post_init__: the defaults of no_rope_layers, moe_layers and layer_types
    no_rope = c("no_rope_layers") or [int((i + 1) % c("no_rope_layer_interval") != 0) for i in range(L)]
    step = c("interleave_moe_layer_step")
    moe_layers = c("moe_layers")
    moe_layers = set(range(step - 1, L, step) if moe_layers is None else moe_layers)
    chunk = c("attention_chunk_size")
    types = c("layer_types") or ["chunked_attention" if r and chunk is not None else "full_attention"
                                 for r in no_rope]
    return {"qk_norm": bool(c("use_qk_norm")), "attn_temperature_tuning": bool(c("attn_temperature_tuning")),
            "layer_kinds": from_layer_types(c, types, window=None, chunk=chunk,
                                            moe=[i in moe_layers for i in range(L)],
                                            rope=[bool(r) for r in no_rope[:L]])}


def _parameters(m: "ModelSpec") -> lay.Params:
    H = m.hidden_size

    def block(pre: str, kind: "LayerKind") -> lay.Params:
        p = attention(f"{pre}.self_attn", m)
        ff = f"{pre}.feed_forward"
        if kind.mlp == "dense":
            return p + dense_mlp(ff, m.ffn_size, H)
        # Llama4TextMoe: experts, router, shared_expert (as wide as one expert)
        return (p + experts(f"{ff}.experts", m, in_major=True) + [(f"{ff}.router.weight", (m.num_experts, H))]
                + dense_mlp(f"{ff}.shared_expert", m.shared_ffn_size, H))

    return kind_blocks(m, block)


@register_family
def llama4_text() -> Family:
    # peft 0.21.2 maps no "llama4_text": q_proj, v_proj (peft's usual pair) are adapted, with a note
    return Family(name="llama4_text", parameters=_parameters, rules=BlockRules(forward="llama4"), **LLAMA_NAMES,
                  peft_default=False,
                  config=ConfigSchema(
                      config_class="Llama4TextConfig", read=_read,
                      keys={**MOE_KEYS, "ffn_size": "intermediate_size_mlp"}, fixed={"num_shared_experts": 1},
                      required=("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                                "intermediate_size", "intermediate_size_mlp"),
                      defaults={"vocab_size": 202048, "hidden_size": 5120, "intermediate_size": 8192,
                                "intermediate_size_mlp": 16384, "num_hidden_layers": 48, "num_attention_heads": 40,
                                "num_key_value_heads": 8, "head_dim": 128, "hidden_act": "silu",
                                "tie_word_embeddings": False, "attention_bias": False, "attention_dropout": 0.0,
                                "num_local_experts": 16, "num_experts_per_tok": 1, "interleave_moe_layer_step": 1,
                                "moe_layers": None, "no_rope_layers": None, "no_rope_layer_interval": 4,
                                "attention_chunk_size": 8192, "layer_types": None,
                                "use_qk_norm": True, "attn_temperature_tuning": True}))
