"""DeepSeek-V2 and V3 (``modeling_deepseek_v2.py``, ``modeling_deepseek_v3.py``): multi-head latent
attention (MLA: low-rank q and joint kv projections, per-axis head dims) and ``first_k_dense_replace``
dense blocks, then MoE blocks (routed experts as fused 3-D tensors, a router ``gate``, shared experts
as one dense MLP). The ``hf`` profile runs their hand-written rules (``estimate/rules_mla.py``);
``--profile traced`` derives the same from a trace."""

from __future__ import annotations

from typing import TYPE_CHECKING

from trainmem.errors import UnsupportedError
from trainmem.families import layout as lay
from trainmem.families.base import BlockRules, ConfigSchema, Family, register_family
from trainmem.families.buffers import deepseek_v3_buffers, rotary_buffers
from trainmem.families.config import ConfigReader, llama_like
from trainmem.families.llama import LLAMA_NAMES
from trainmem.families.moe_layout import dense_mlp, experts, kind_blocks

if TYPE_CHECKING:  # pragma: no cover
    from trainmem.specs.layer_kind import LayerKind
    from trainmem.specs.model import ModelSpec

_SIZES = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size",
          "moe_intermediate_size", "n_routed_experts", "num_experts_per_tok")


def _read(c: ConfigReader) -> dict:
    freq = c("moe_layer_freq")
    if freq not in (None, 1):  # transformers' DeepseekV2/V3DecoderLayer look at first_k_dense_replace only
        raise UnsupportedError(f"{c.model_type} moe_layer_freq={freq!r}: transformers builds MoE in every block "
                               f"from first_k_dense_replace on; other frequencies are not modelled")
    # DeepseekV2TopkRouter.forward knows two methods; DeepseekV3's router has one (a V3 file's
    # "topk_method": "noaux_tc" is not read by DeepseekV3Config)
    method = c("topk_method") if c.model_type == "deepseek_v2" else "noaux_tc"
    if method not in ("greedy", "group_limited_greedy", "noaux_tc"):
        raise UnsupportedError(f"{c.model_type} topk_method={method!r}: transformers' router selects with "
                               f"greedy or group_limited_greedy only")
    L, dense = c("num_hidden_layers"), c("first_k_dense_replace")
    nope, rope = c("qk_nope_head_dim"), c("qk_rope_head_dim")
    heads = c("num_attention_heads")
    return {**llama_like(c), "num_kv_heads": heads, "head_dim": nope + rope,
            "mlp_bias": bool(c("mlp_bias")),
            "num_experts": c("n_routed_experts"), "top_k": c("num_experts_per_tok"),
            "expert_ffn_size": c("moe_intermediate_size"), "num_shared_experts": c("n_shared_experts") or 0,
            "q_lora_rank": c("q_lora_rank") or 0, "kv_lora_rank": c("kv_lora_rank"),
            "qk_nope_head_dim": nope, "qk_rope_head_dim": rope, "v_head_dim": c("v_head_dim"),
            # DeepseekV3TopkRouter renormalizes with norm_topk_prob; DeepseekV2TopkRouter never does
            "router_norm_topk": c.model_type == "deepseek_v3" and bool(c("norm_topk_prob")),
            "router_group_mask": method == "group_limited_greedy",
            "layer_kinds": tuple({"mlp": "dense" if i < dense else "moe"} for i in range(L))}


def _parameters(m: "ModelSpec") -> lay.Params:
    H, A = m.hidden_size, m.num_heads
    qk, nope, v = m.head_dim, m.qk_nope_head_dim, m.v_head_dim

    def block(pre: str, kind: "LayerKind") -> lay.Params:
        at = f"{pre}.self_attn"
        if m.q_lora_rank:
            p = lay.linear(f"{at}.q_a_proj", m.q_lora_rank, H, m.qkv_bias)
            p += lay.norm(m, f"{at}.q_a_layernorm", m.q_lora_rank)
            p += lay.linear(f"{at}.q_b_proj", A * qk, m.q_lora_rank, False)
        else:
            p = lay.linear(f"{at}.q_proj", A * qk, H, False)
        p += lay.linear(f"{at}.kv_a_proj_with_mqa", m.kv_lora_rank + m.qk_rope_head_dim, H, m.qkv_bias)
        p += lay.norm(m, f"{at}.kv_a_layernorm", m.kv_lora_rank)
        p += lay.linear(f"{at}.kv_b_proj", A * (nope + v), m.kv_lora_rank, False)
        p += lay.linear(f"{at}.o_proj", H, A * v, m.out_bias)
        if kind.mlp == "dense":
            return p + dense_mlp(f"{pre}.mlp", m.ffn_size, H, m.mlp_bias)
        # DeepseekV3MoE: experts, then the router (``gate``, fp32 weight), then the shared experts
        p += experts(f"{pre}.mlp.experts", m, in_major=False)
        p.append((f"{pre}.mlp.gate.weight", (m.num_experts, H)))
        if m.num_shared_experts:
            p += dense_mlp(f"{pre}.mlp.shared_experts", m.shared_ffn_size, H, m.mlp_bias)
        return p

    return kind_blocks(m, block)


def _family(name: str, config_class: str, defaults: dict, fp32_params: tuple[str, ...], buffers=rotary_buffers) -> Family:
    # peft 0.21.2 maps no deepseek_v2/v3; MLA has no v_proj: the query projection (q_proj, or q_b_proj
    # after the low-rank q_a_proj) and kv_b_proj (which makes K's no-rope part and V) are adapted, with a note
    return Family(name=name, parameters=_parameters, rules=BlockRules(forward="mla"), **LLAMA_NAMES,
                  fp32_params=fp32_params, peft_default=False, buffers=buffers, lora_targets=("q_proj", "q_b_proj", "kv_b_proj"),
                  config=ConfigSchema(config_class=config_class, read=_read, defaults=defaults, required=_SIZES))


_COMMON = {"num_key_value_heads": None, "head_dim": None, "hidden_act": "silu", "tie_word_embeddings": False,
           "attention_bias": False, "attention_dropout": 0.0, "moe_layer_freq": None, "mlp_bias": False,
           "norm_topk_prob": False, "topk_method": "greedy"}


@register_family
def deepseek_v2() -> Family:
    return _family("deepseek_v2", "DeepseekV2Config", {
        **_COMMON, "vocab_size": 102400, "hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32,
        "num_attention_heads": 32, "first_k_dense_replace": 0, "kv_lora_rank": 512, "q_lora_rank": 1536,
        "n_routed_experts": 64, "n_shared_experts": 2, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
        # DeepseekV2Config's num_experts_per_tok defaults to None, which its router cannot route with;
        # a file must write it (required), so this stands in only for the registry's own checks
        "v_head_dim": 128, "num_experts_per_tok": 6, "moe_intermediate_size": 1407},
        # DeepseekV2PreTrainedModel._keep_in_fp32_modules_strict (transformers 5.x)
        fp32_params=("gate.weight",))


@register_family
def deepseek_v3() -> Family:
    return _family("deepseek_v3", "DeepseekV3Config", {
        **_COMMON, "vocab_size": 129280, "hidden_size": 7168, "intermediate_size": 18432, "num_hidden_layers": 61,
        "num_attention_heads": 128, "first_k_dense_replace": 3, "kv_lora_rank": 512, "q_lora_rank": 1536,
        "n_routed_experts": 256, "n_shared_experts": 1, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
        "v_head_dim": 128, "num_experts_per_tok": 8, "moe_intermediate_size": 2048, "norm_topk_prob": True},
        # DeepseekV3PreTrainedModel._keep_in_fp32_modules_strict; the bias is a buffer (the buffer ledger)
        fp32_params=("e_score_correction_bias", "gate.weight"), buffers=deepseek_v3_buffers)
