"""Phi-3 (``modeling_phi3.py``): the Llama block with fused ``qkv_proj`` and ``gate_up_proj``."""

from __future__ import annotations

from typing import TYPE_CHECKING

from trainmem.families import layout as lay
from trainmem.families.base import BlockRules, ConfigSchema, Family, TPRoles, register_family
from trainmem.families.config import ConfigReader
from trainmem.families.kinds import uniform_window
from trainmem.families.llama import LLAMA_NAMES, llama_family

if TYPE_CHECKING:  # pragma: no cover
    from trainmem.specs.model import ModelSpec


def _parameters(m: "ModelSpec") -> lay.Params:
    lay.refuse(m, "MoE", "qk_norm", "max_positions", "type_vocab_size")
    H, F = m.hidden_size, m.ffn_size
    params = lay.embedding("model.embed_tokens", m.vocab_size, H)
    for i in range(m.num_layers):
        pre = f"model.layers.{i}"
        # Phi3Attention registers o_proj before the fused qkv_proj
        params += lay.linear(f"{pre}.self_attn.o_proj", H, m.q_size, m.out_bias)
        params += lay.linear(f"{pre}.self_attn.qkv_proj", m.q_size + 2 * m.kv_size, H, m.qkv_bias)
        params += lay.linear(f"{pre}.mlp.gate_up_proj", lay.up_width(m, F), H, m.mlp_bias)
        params += lay.linear(f"{pre}.mlp.down_proj", H, F, m.mlp_bias)
        params += lay.norm(m, f"{pre}.input_layernorm")
        params += lay.norm(m, f"{pre}.post_attention_layernorm")
    params += lay.norm(m, "model.norm")
    return params + lay.lm_head(m)


def _read(c: ConfigReader) -> dict:
    return {"layer_kinds": uniform_window(c)}


@register_family
def phi3() -> Family:
    return llama_family("phi3", ConfigSchema(
        # ``embd_pdrop`` exists but Phi3Model applies no embedding dropout
        config_class="Phi3Config", read=_read, bias=False, keys={"hidden_dropout": "resid_pdrop"},
        defaults={"vocab_size": 32064, "hidden_size": 3072, "intermediate_size": 8192, "num_hidden_layers": 32,
                  "num_attention_heads": 32, "num_key_value_heads": None, "head_dim": None, "hidden_act": "silu",
                  "tie_word_embeddings": False, "attention_dropout": 0.0, "resid_pdrop": 0.0,
                  "sliding_window": None}),
        parameters=_parameters, rules=BlockRules(forward="llama", fused_qkv=True, fused_gate_up=True),
        tp=TPRoles(column=("qkv_proj", "gate_up_proj"), row=LLAMA_NAMES["tp"].row, vocab=LLAMA_NAMES["tp"].vocab,
                   packed=("qkv_proj", "gate_up_proj")),
        # peft 0.21.2 maps no "phi3" (only "phi"); the fused projection holding q and v is adapted
        lora_targets=("qkv_proj",), peft_default=False,
        compiled_rules=True, compiled_narrow=True)  # the Llama compiled block with fused outputs (estimate/rules_compiled.py)
