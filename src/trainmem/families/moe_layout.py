"""Parameter pieces of the MoE families whose blocks differ (DeepSeek, Llama-4, gpt-oss, qwen3_next)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from trainmem.families import layout as lay

if TYPE_CHECKING:  # pragma: no cover
    from trainmem.specs.model import ModelSpec

__all__ = ["attention", "dense_mlp", "experts", "kind_blocks", "router_aux_loss"]


def router_aux_loss(c) -> bool:
    """``output_router_logits``: the CausalLM adds ``load_balancing_loss_func``'s loss (a bool in the config)."""
    from trainmem.errors import SpecError

    value = c("output_router_logits")
    if not isinstance(value, bool):
        raise SpecError("output_router_logits", value, "must be true or false")
    return value


def attention(at: str, m: "ModelSpec") -> lay.Params:
    """Llama-style attention projections: ``q_proj``, ``k_proj``, ``v_proj`` (``qkv_bias``) and
    ``o_proj`` (``out_bias``)."""
    H = m.hidden_size
    return (lay.linear(f"{at}.q_proj", m.q_size, H, m.qkv_bias) + lay.linear(f"{at}.k_proj", m.kv_size, H, m.qkv_bias)
            + lay.linear(f"{at}.v_proj", m.kv_size, H, m.qkv_bias)
            + lay.linear(f"{at}.o_proj", H, m.q_size, m.out_bias))


def dense_mlp(pre: str, F: int, H: int, bias: bool = False) -> lay.Params:
    """A gated MLP: ``gate_proj``, ``up_proj``, ``down_proj``."""
    return (lay.linear(f"{pre}.gate_proj", F, H, bias) + lay.linear(f"{pre}.up_proj", F, H, bias)
            + lay.linear(f"{pre}.down_proj", H, F, bias))


def experts(pre: str, m: "ModelSpec", *, in_major: bool, bias: bool = False) -> lay.Params:
    """Fused 3-D experts: ``gate_up_proj`` ``(E, 2F, H)`` and ``down_proj`` ``(E, H, F)``, or, with
    ``in_major`` (Llama-4, gpt-oss), ``(E, H, 2F)`` and ``(E, F, H)``; gpt-oss adds their biases."""
    E, F, H = m.num_experts, m.expert_ffn_size, m.hidden_size
    params: lay.Params = [(f"{pre}.gate_up_proj", (E, H, 2 * F) if in_major else (E, 2 * F, H))]
    if bias:
        params.append((f"{pre}.gate_up_proj_bias", (E, 2 * F)))
    params.append((f"{pre}.down_proj", (E, F, H) if in_major else (E, H, F)))
    if bias:
        params.append((f"{pre}.down_proj_bias", (E, H)))
    return params


def kind_blocks(m: "ModelSpec", block, container: str = "model.layers") -> lay.Params:
    """Every block's parameters, ``block(prefix, kind)`` per block, between the token embedding
    and the final norm and LM head (the Llama-style outer layout)."""
    H = m.hidden_size
    params = lay.embedding("model.embed_tokens", m.vocab_size, H)
    for i, kind in enumerate(m.kinds):
        pre = f"{container}.{i}"
        params += block(pre, kind)
        params += lay.norm(m, f"{pre}.input_layernorm")
        params += lay.norm(m, f"{pre}.post_attention_layernorm")
    params += lay.norm(m, "model.norm")
    return params + lay.lm_head(m)
