"""GPT-NeoX (``modeling_gpt_neox.py``): partial rotary embeddings, a packed ``query_key_value``,
parallel residual by default; the head is ``lm_head`` (transformers 5.x; 4.x: ``embed_out``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from trainmem.families import layout as lay
from trainmem.families.base import BlockRules, ConfigSchema, Family, TaskHeads, TPRoles, register_family
from trainmem.families.buffers import rotary
from trainmem.families.config import ConfigReader

if TYPE_CHECKING:  # pragma: no cover
    from trainmem.specs.model import ModelSpec


def _parameters(m: "ModelSpec") -> lay.Params:
    lay.refuse(m, "MoE", "qk_norm", "max_positions", "type_vocab_size")
    H, F = m.hidden_size, m.ffn_size
    params = lay.embedding("gpt_neox.embed_in", m.vocab_size, H)
    for i in range(m.num_layers):
        pre = f"gpt_neox.layers.{i}"
        params += lay.norm(m, f"{pre}.input_layernorm")
        params += lay.norm(m, f"{pre}.post_attention_layernorm")
        params += lay.linear(f"{pre}.attention.query_key_value", m.q_size + 2 * m.kv_size, H, m.qkv_bias)
        params += lay.linear(f"{pre}.attention.dense", H, m.q_size, m.out_bias)
        params += lay.linear(f"{pre}.mlp.dense_h_to_4h", lay.up_width(m, F), H, m.mlp_bias)
        params += lay.linear(f"{pre}.mlp.dense_4h_to_h", H, F, m.mlp_bias)
    params += lay.norm(m, "gpt_neox.final_layer_norm")
    return params + lay.lm_head(m)


def _rotary_fraction(c: ConfigReader) -> float:
    """GPT-NeoX's rotated share of each head: ``rotary_pct`` (4.x) or
    ``rope_parameters.partial_rotary_factor`` (5.x)."""
    rope = c.cfg.get("rope_parameters") or {}
    if "partial_rotary_factor" in rope:
        return float(rope["partial_rotary_factor"])
    return float(c("rotary_pct"))


def _read(c: ConfigReader) -> dict:
    return {"rotary_dim": int(c("hidden_size") // c("num_attention_heads") * _rotary_fraction(c))}


@register_family
def gpt_neox() -> Family:
    return Family(
        name="gpt_neox",
        config=ConfigSchema(
            config_class="GPTNeoXConfig", read=_read, base="layernorm",
            # emb_dropout, post_attention_dropout and post_mlp_dropout all use hidden_dropout
            keys={"attn_dropout": "attention_dropout", "hidden_dropout": "hidden_dropout",
                  "embd_dropout": "hidden_dropout", "parallel_residual": "use_parallel_residual"},
            defaults={"vocab_size": 50432, "hidden_size": 6144, "num_hidden_layers": 44, "num_attention_heads": 64,
                      "intermediate_size": 24576, "hidden_act": "gelu", "attention_dropout": 0.0,
                      "hidden_dropout": 0.0, "max_position_embeddings": 2048, "tie_word_embeddings": False,
                      "use_parallel_residual": True, "attention_bias": True, "rotary_pct": 0.25}),
        parameters=_parameters, rules=BlockRules(forward="gpt", neox=True),
        embeddings=("gpt_neox.embed_in",), head=("gpt_neox.final_layer_norm", "lm_head"),
        layers="gpt_neox.layers",
        tp=TPRoles(column=("query_key_value", "dense_h_to_4h"), row=("attention.dense", "dense_4h_to_h"),
                   vocab=("embed_in", "embed_out"), packed=("query_key_value",)),
        # GPTNeoXForSequenceClassification: score (no bias); GPTNeoXForTokenClassification: classifier
        # and ForTokenClassification's loss (fp32 logits)
        task_heads=TaskHeads("score", False, "classifier", True, True),
        lora_targets=("query_key_value",),  # peft: "gpt_neox": ["query_key_value"]
        buffers=lambda m: rotary("gpt_neox.rotary_emb", m))
