"""GPT-2 (``modeling_gpt2.py``): learned positions, LayerNorm, ``Conv1D`` linears (weights
stored ``[in, out]``), a packed ``c_attn``."""

from __future__ import annotations

from typing import TYPE_CHECKING

from trainmem.families import layout as lay
from trainmem.families.base import BlockRules, ConfigSchema, Family, TaskHeads, TPRoles, register_family
from trainmem.families.buffers import no_buffers
from trainmem.families.config import ConfigReader

if TYPE_CHECKING:  # pragma: no cover
    from trainmem.specs.model import ModelSpec


def _parameters(m: "ModelSpec") -> lay.Params:
    lay.refuse(m, "MoE", "qk_norm", "type_vocab_size")
    H, F = m.hidden_size, m.ffn_size
    params = lay.embedding("transformer.wte", m.vocab_size, H)
    if m.max_positions:
        params += lay.embedding("transformer.wpe", m.max_positions, H)
    for i in range(m.num_layers):
        pre = f"transformer.h.{i}"
        params += lay.norm(m, f"{pre}.ln_1")
        params += lay.conv1d(f"{pre}.attn.c_attn", H, m.q_size + 2 * m.kv_size, m.qkv_bias)
        params += lay.conv1d(f"{pre}.attn.c_proj", m.q_size, H, m.out_bias)
        params += lay.norm(m, f"{pre}.ln_2")
        params += lay.conv1d(f"{pre}.mlp.c_fc", H, lay.up_width(m, F), m.mlp_bias)
        params += lay.conv1d(f"{pre}.mlp.c_proj", F, H, m.mlp_bias)
    params += lay.norm(m, "transformer.ln_f")
    return params + lay.lm_head(m)


def _read(c: ConfigReader) -> dict:
    inner = c("n_inner")
    return {"ffn_size": 4 * c("n_embd") if inner is None else inner}


@register_family
def gpt2() -> Family:
    return Family(
        name="gpt2",
        config=ConfigSchema(
            config_class="GPT2Config", read=_read, base="layernorm", act_key="activation_function", bias=True,
            refuse={"add_cross_attention": "cross-attention layers are not modelled"},
            keys={"hidden_size": "n_embd", "num_layers": "n_layer", "num_heads": "n_head", "ffn_size": None,
                  "max_positions": "n_positions", "attn_dropout": "attn_pdrop", "hidden_dropout": "resid_pdrop",
                  "embd_dropout": "embd_pdrop"},
            defaults={"vocab_size": 50257, "n_positions": 1024, "n_embd": 768, "n_layer": 12, "n_head": 12,
                      "n_inner": None, "activation_function": "gelu_new", "resid_pdrop": 0.1, "embd_pdrop": 0.1,
                      "attn_pdrop": 0.1, "tie_word_embeddings": True, "add_cross_attention": False},
            aliases={"n_embd": "hidden_size", "n_layer": "num_hidden_layers", "n_head": "num_attention_heads",
                     "n_positions": "max_position_embeddings"},
            # n_inner is not required: None means 4·n_embd
            required=("vocab_size", "n_embd", "n_layer", "n_head")),
        parameters=_parameters, rules=BlockRules(forward="gpt"),
        embeddings=("transformer.wte", "transformer.wpe"), head=("transformer.ln_f", "lm_head"),
        layers="transformer.h",
        tp=TPRoles(column=("c_attn", "c_fc"), row=("c_proj",), vocab=("wte",), packed=("c_attn",)),
        conv1d=True,
        # GPT2ForSequenceClassification: score (no bias); GPT2ForTokenClassification: classifier, with an
        # inline CrossEntropyLoss (no upcast)
        task_heads=TaskHeads("score", False, "classifier", True, False),
        lora_targets=("c_attn",), buffers=no_buffers,  # peft: "gpt2": ["c_attn"]; no buffers in 5.24
        compiled_rules=True)  # its own compiled block (estimate/rules_compiled_gpt2.py)
