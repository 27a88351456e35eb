"""Llama (``LlamaForCausalLM``) and ``generic``: the pre-norm RMSNorm decoder with rotary
embeddings and a gated MLP whose layout most families share (``modeling_llama.py``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from trainmem.families import layout as lay
from trainmem.families.base import BlockRules, ConfigSchema, Family, TPRoles, register_family

if TYPE_CHECKING:  # pragma: no cover
    from trainmem.specs.model import ModelSpec

__all__ = ["LLAMA_NAMES", "llama_parameters", "llama_family"]

#: Module paths of the Llama layout, shared by every Llama-like family.
LLAMA_NAMES = dict(
    embeddings=("model.embed_tokens", "model.embed_positions", "model.embed_token_types"),
    head=("model.norm", "lm_head"),
    layers="model.layers",
    tp=TPRoles(column=("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"), row=("o_proj", "down_proj"),
               vocab=("embed_tokens", "lm_head"), kv=("k_proj", "v_proj")),
)


def _mlp(m: "ModelSpec", pre: str) -> lay.Params:
    H, bias = m.hidden_size, m.mlp_bias
    if not m.is_moe:
        return _dense_mlp(m, pre, m.ffn_size)
    E, F = m.num_experts, m.expert_ffn_size
    # MixtralSparseMoeBlock: router, then experts as fused 3-D tensors
    params: lay.Params = [(f"{pre}.gate.weight", (E, H))]
    up = "gate_up_proj" if m.gated else "up_proj"
    params.append((f"{pre}.experts.{up}", (E, lay.up_width(m, F), H)))
    if bias:
        params.append((f"{pre}.experts.{up}_bias", (E, lay.up_width(m, F))))
    params.append((f"{pre}.experts.down_proj", (E, H, F)))
    if bias:
        params.append((f"{pre}.experts.down_proj_bias", (E, H)))
    if m.num_shared_experts:
        # DeepSeek-style: one dense MLP as wide as all shared experts together
        params += _dense_mlp(m, f"{pre}.shared_experts", m.num_shared_experts * F)
    return params


def _dense_mlp(m: "ModelSpec", pre: str, F: int) -> lay.Params:
    H, bias = m.hidden_size, m.mlp_bias
    params: lay.Params = []
    if m.gated:
        params += lay.linear(f"{pre}.gate_proj", F, H, bias)
    params += lay.linear(f"{pre}.up_proj", F, H, bias)
    params += lay.linear(f"{pre}.down_proj", H, F, bias)
    return params


def llama_parameters(m: "ModelSpec", *, sandwich_norms: bool = False) -> lay.Params:
    """The Llama layout (``named_parameters()`` of ``LlamaForCausalLM``); ``sandwich_norms``:
    Gemma-2's extra ``pre_/post_feedforward_layernorm``."""
    H = m.hidden_size
    params = lay.embedding("model.embed_tokens", m.vocab_size, H)
    if m.max_positions:
        params += lay.embedding("model.embed_positions", m.max_positions, H)
    if m.type_vocab_size:
        params += lay.embedding("model.embed_token_types", m.type_vocab_size, H)
    for i in range(m.num_layers):
        pre = f"model.layers.{i}"
        attn = f"{pre}.self_attn"
        params += lay.linear(f"{attn}.q_proj", m.q_size, H, m.qkv_bias)
        params += lay.linear(f"{attn}.k_proj", m.kv_size, H, m.qkv_bias)
        params += lay.linear(f"{attn}.v_proj", m.kv_size, H, m.qkv_bias)
        params += lay.linear(f"{attn}.o_proj", H, m.q_size, m.out_bias)
        if m.qk_norm:
            params += lay.norm(m, f"{attn}.q_norm", m.head_dim)
            params += lay.norm(m, f"{attn}.k_norm", m.head_dim)
        params += _mlp(m, f"{pre}.mlp")
        params += lay.norm(m, f"{pre}.input_layernorm")
        params += lay.norm(m, f"{pre}.post_attention_layernorm")
        if sandwich_norms:
            params += lay.norm(m, f"{pre}.pre_feedforward_layernorm")
            params += lay.norm(m, f"{pre}.post_feedforward_layernorm")
    params += lay.norm(m, "model.norm")
    return params + lay.lm_head(m)


def llama_family(name: str, config: ConfigSchema | None, **kw) -> Family:
    """A family with the Llama layout and block rules (``kw`` overrides, e.g. ``rules``)."""
    return Family(name=name, config=config, **{"parameters": llama_parameters,
                                               "rules": BlockRules(forward="llama"), **LLAMA_NAMES, **kw})


@register_family
def llama() -> Family:
    # peft's default: "llama": ["q_proj", "v_proj"] (the Family default)
    return llama_family("llama", compiled_rules=True, config=ConfigSchema(
        config_class="LlamaConfig (Llama-2-7B)", keys={"mlp_bias": "mlp_bias"},
        defaults={"vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32,
                  "num_attention_heads": 32, "num_key_value_heads": None, "head_dim": None, "hidden_act": "silu",
                  "tie_word_embeddings": False, "attention_bias": False, "attention_dropout": 0.0,
                  "mlp_bias": False}))
