"""Qwen3-Next (``modeling_qwen3_next.py``): hybrid blocks, gated-DeltaNet linear attention
(``linear_attn``: conv1d, fused qkvz and ba projections, gated RMSNorm) and gated full attention
(``self_attn``: q_proj twice as wide for the output gate, q/k norms) per ``layer_types`` (default:
three linear, one full), an MoE MLP (``decoder_sparse_step``, ``mlp_only_layers``) with a gated shared
expert. The ``hf`` profile has no hand-written rules for it: ``--profile traced``."""

from __future__ import annotations

from typing import TYPE_CHECKING

from trainmem.families import layout as lay
from trainmem.families.base import BlockRules, ConfigSchema, Family, register_family
from trainmem.families.config import ConfigReader
from trainmem.families.kinds import from_layer_types
from trainmem.families.llama import LLAMA_NAMES
from trainmem.families.moe_layout import dense_mlp, experts, kind_blocks

if TYPE_CHECKING:  # pragma: no cover
    from trainmem.specs.layer_kind import LayerKind
    from trainmem.specs.model import ModelSpec


def _rotary_dim(c: ConfigReader) -> int:
    """The rotated dims per head: ``int(head_dim * partial_rotary_factor)`` (Qwen3NextRotaryEmbedding.
    compute_default_rope_parameters), the factor 0.25 unless ``rope_parameters`` or the file says
    (``Qwen3NextConfig.__init__``: ``kwargs.setdefault("partial_rotary_factor", 0.25)``)."""
    rope = c.cfg.get("rope_parameters") or {}
    factor = rope.get("partial_rotary_factor", c.cfg.get("partial_rotary_factor", 0.25))
    head_dim = c.cfg.get("head_dim") or c("head_dim")
    return int(head_dim * float(factor))


def _read(c: ConfigReader) -> dict:
    L, E = c("num_hidden_layers"), c("num_experts")
    # Qwen3NextConfig.__post_init__: layer_types from full_attention_interval (default 4)
    interval = c("full_attention_interval")
    types = c("layer_types") or ["linear_attention" if (i + 1) % interval else "full_attention" for i in range(L)]
    only = set(c("mlp_only_layers") or ())
    moe = [i not in only and E > 0 and (i + 1) % c("decoder_sparse_step") == 0 for i in range(L)]
    shared = c("shared_expert_intermediate_size")
    return {"num_experts": E, "top_k": c("num_experts_per_tok") if E else 0,
            "expert_ffn_size": c("moe_intermediate_size") if E else 0,
            "num_shared_experts": 1 if E and shared else 0, "shared_expert_ffn_size": shared if E else 0,
            "linear_num_key_heads": c("linear_num_key_heads"), "linear_num_value_heads": c("linear_num_value_heads"),
            "linear_key_head_dim": c("linear_key_head_dim"), "linear_value_head_dim": c("linear_value_head_dim"),
            "linear_conv_kernel": c("linear_conv_kernel_dim"), "rotary_dim": _rotary_dim(c),
            "layer_kinds": from_layer_types(c, types, window=None, moe=moe)}


def _parameters(m: "ModelSpec") -> lay.Params:
    H = m.hidden_size
    kd, vd = m.linear_num_key_heads * m.linear_key_head_dim, m.linear_num_value_heads * m.linear_value_head_dim
    Hv = m.linear_num_value_heads

    def block(pre: str, kind: "LayerKind") -> lay.Params:
        if kind.attention == "linear":  # Qwen3NextGatedDeltaNet
            at = f"{pre}.linear_attn"
            p: lay.Params = [(f"{at}.dt_bias", (Hv,)), (f"{at}.A_log", (Hv,)),
                             (f"{at}.conv1d.weight", (2 * kd + vd, 1, m.linear_conv_kernel))]
            p += lay.linear(f"{at}.in_proj_qkvz", 2 * kd + 2 * vd, H, False)
            p += lay.linear(f"{at}.in_proj_ba", 2 * Hv, H, False)
            p += lay.norm(m, f"{at}.norm", m.linear_value_head_dim)
            p += lay.linear(f"{at}.out_proj", H, vd, False)
        else:  # Qwen3NextAttention: q_proj also produces the output gate
            at = f"{pre}.self_attn"
            p = lay.linear(f"{at}.q_proj", 2 * m.q_size, H, m.qkv_bias)
            p += lay.linear(f"{at}.k_proj", m.kv_size, H, m.qkv_bias) + lay.linear(f"{at}.v_proj", m.kv_size, H, m.qkv_bias)
            p += lay.linear(f"{at}.o_proj", H, m.q_size, m.qkv_bias)
            p += lay.norm(m, f"{at}.q_norm", m.head_dim) + lay.norm(m, f"{at}.k_norm", m.head_dim)
        if kind.mlp == "dense":
            return p + dense_mlp(f"{pre}.mlp", m.ffn_size, H)
        # Qwen3NextSparseMoeBlock: gate, experts, shared_expert, shared_expert_gate
        p += [(f"{pre}.mlp.gate.weight", (m.num_experts, H))] + experts(f"{pre}.mlp.experts", m, in_major=False)
        if m.num_shared_experts:
            p += dense_mlp(f"{pre}.mlp.shared_expert", m.shared_ffn_size, H)
            p += lay.linear(f"{pre}.mlp.shared_expert_gate", 1, H, False)
        return p

    return kind_blocks(m, block)


@register_family
def qwen3_next() -> Family:
    # peft 0.21.2 maps no "qwen3_next": q_proj, v_proj (peft's usual pair) are adapted, with a note
    return Family(name="qwen3_next", parameters=_parameters, rules=BlockRules(forward="traced"), **LLAMA_NAMES,
                  peft_default=False,
                  config=ConfigSchema(
                      config_class="Qwen3NextConfig", read=_read, fixed={"qk_norm": True},
                      defaults={"vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 5632,
                                "moe_intermediate_size": 512, "shared_expert_intermediate_size": 512,
                                "num_hidden_layers": 48, "num_attention_heads": 16, "num_key_value_heads": 2,
                                "head_dim": 256, "hidden_act": "silu", "tie_word_embeddings": False,
                                "attention_bias": False, "attention_dropout": 0.0, "num_experts": 512,
                                "num_experts_per_tok": 10, "decoder_sparse_step": 1, "mlp_only_layers": None,
                                "layer_types": None, "full_attention_interval": 4, "linear_conv_kernel_dim": 4,
                                "linear_key_head_dim": 128, "linear_value_head_dim": 128,
                                "linear_num_key_heads": 16, "linear_num_value_heads": 32}))
