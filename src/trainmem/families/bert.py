"""BERT (``modeling_bert.py``): the post-norm encoder with learned position and token-type
embeddings and the masked-LM head ``cls.predictions``."""

from __future__ import annotations

from typing import TYPE_CHECKING

from trainmem.families import layout as lay
from trainmem.families.base import BlockRules, ConfigSchema, Family, TaskHeads, TPRoles, register_family
from trainmem.families.buffers import bert_buffers

if TYPE_CHECKING:  # pragma: no cover
    from trainmem.specs.model import ModelSpec

#: BertForSequenceClassification (BertPooler: dense + tanh on the first token, then ``classifier``
#: with a bias) and BertForTokenClassification (``classifier``), both with an inline CrossEntropyLoss
BERT_TASK_HEADS = TaskHeads("classifier", True, "classifier", True, False, pooler="bert.pooler")


def _parameters(m: "ModelSpec") -> lay.Params:
    lay.refuse(m, "MoE", "qk_norm")
    H, F, V = m.hidden_size, m.ffn_size, m.vocab_size
    params = lay.embedding("bert.embeddings.word_embeddings", V, H)
    if m.max_positions:
        params += lay.embedding("bert.embeddings.position_embeddings", m.max_positions, H)
    if m.type_vocab_size:
        params += lay.embedding("bert.embeddings.token_type_embeddings", m.type_vocab_size, H)
    params += lay.norm(m, "bert.embeddings.LayerNorm")
    for i in range(m.num_layers):
        pre = f"bert.encoder.layer.{i}"
        params += lay.linear(f"{pre}.attention.self.query", m.q_size, H, m.qkv_bias)
        params += lay.linear(f"{pre}.attention.self.key", m.kv_size, H, m.qkv_bias)
        params += lay.linear(f"{pre}.attention.self.value", m.kv_size, H, m.qkv_bias)
        params += lay.linear(f"{pre}.attention.output.dense", H, m.q_size, m.out_bias)
        params += lay.norm(m, f"{pre}.attention.output.LayerNorm")
        params += lay.linear(f"{pre}.intermediate.dense", lay.up_width(m, F), H, m.mlp_bias)
        params += lay.linear(f"{pre}.output.dense", H, F, m.mlp_bias)
        params += lay.norm(m, f"{pre}.output.LayerNorm")
    # BertLMPredictionHead: its own output bias is registered before its submodules
    params.append(("cls.predictions.bias", (V,)))
    params += lay.linear("cls.predictions.transform.dense", H, H, True)
    params += lay.norm(m, "cls.predictions.transform.LayerNorm")
    if not m.tied_embeddings:
        # untied, the decoder keeps its own weight and bias (transformers 5.x)
        params += lay.linear("cls.predictions.decoder", V, H, True)
    return params


@register_family
def bert() -> Family:
    return Family(
        name="bert",
        config=ConfigSchema(
            config_class="BertConfig", base="layernorm", bias=True, fixed={"arch": "encoder"},
            refuse={"add_cross_attention": "cross-attention layers are not modelled"},
            # BertEmbeddings, BertSelfOutput and BertOutput all drop out with hidden_dropout_prob
            keys={"max_positions": "max_position_embeddings", "type_vocab_size": "type_vocab_size",
                  "attn_dropout": "attention_probs_dropout_prob", "hidden_dropout": "hidden_dropout_prob",
                  "embd_dropout": "hidden_dropout_prob"},
            defaults={"vocab_size": 30522, "hidden_size": 768, "num_hidden_layers": 12, "num_attention_heads": 12,
                      "intermediate_size": 3072, "hidden_act": "gelu", "hidden_dropout_prob": 0.1,
                      "attention_probs_dropout_prob": 0.1, "max_position_embeddings": 512, "type_vocab_size": 2,
                      "tie_word_embeddings": True, "add_cross_attention": False}),
        parameters=_parameters, rules=BlockRules(forward="bert"), encoder=True,
        embeddings=("bert.embeddings.word_embeddings", "bert.embeddings.position_embeddings",
                    "bert.embeddings.token_type_embeddings"),
        head=("cls",), layers="bert.encoder.layer", output_layer="cls.predictions.decoder",
        tp=TPRoles(column=("query", "key", "value", "intermediate.dense"), row=("output.dense",),
                   vocab=("word_embeddings", "decoder"), kv=("key", "value")),
        task_heads=BERT_TASK_HEADS, lora_targets=("query", "value"), buffers=bert_buffers)  # peft: "bert": ["query", "value"]
