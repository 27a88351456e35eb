"""Qwen3-MoE (``modeling_qwen3_moe.py``, transformers 5.x): Qwen3 attention (per-head q/k RMSNorm)
and a sparse MoE MLP (router ``gate`` with softmax, top-k and ``norm_topk_prob``, experts as fused
3-D tensors) in every ``decoder_sparse_step``-th block not in ``mlp_only_layers``; those are dense."""

from __future__ import annotations

from typing import TYPE_CHECKING

from trainmem.families import layout as lay
from trainmem.families.base import BlockRules, ConfigSchema, Family, register_family
from trainmem.families.config import ConfigReader
from trainmem.families.kinds import qwen_windows
from trainmem.families.llama import LLAMA_NAMES
from trainmem.families.moe_layout import attention, dense_mlp, experts, kind_blocks, router_aux_loss

if TYPE_CHECKING:  # pragma: no cover
    from trainmem.specs.layer_kind import LayerKind
    from trainmem.specs.model import ModelSpec

_SIZES = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size",
          "moe_intermediate_size", "num_experts", "num_experts_per_tok")


def _read(c: ConfigReader) -> dict:
    L, step = c("num_hidden_layers"), c("decoder_sparse_step")
    only = set(c("mlp_only_layers") or ())
    # Qwen3MoeDecoderLayer.__init__: MoE where not mlp_only and (i + 1) % decoder_sparse_step == 0
    moe = [i not in only and c("num_experts") > 0 and (i + 1) % step == 0 for i in range(L)]
    windows = qwen_windows(c) or tuple({} for _ in range(L))
    return {"router_norm_topk": bool(c("norm_topk_prob")), "router_aux_loss": router_aux_loss(c),
            "layer_kinds": tuple({**w, "mlp": "moe" if moe[i] else "dense"} for i, w in enumerate(windows))}


def _parameters(m: "ModelSpec") -> lay.Params:
    H = m.hidden_size

    def block(pre: str, kind: "LayerKind") -> lay.Params:
        at = f"{pre}.self_attn"
        p = attention(at, m) + lay.norm(m, f"{at}.q_norm", m.head_dim) + lay.norm(m, f"{at}.k_norm", m.head_dim)
        if kind.mlp == "dense":
            return p + dense_mlp(f"{pre}.mlp", m.ffn_size, H)
        # Qwen3MoeSparseMoeBlock: experts, then the router
        return p + experts(f"{pre}.mlp.experts", m, in_major=False) + [(f"{pre}.mlp.gate.weight", (m.num_experts, H))]

    return kind_blocks(m, block)


@register_family
def qwen3_moe() -> Family:
    # peft 0.21.2 maps no "qwen3_moe": q_proj, v_proj (peft's usual pair) are adapted, with a note
    return Family(name="qwen3_moe", parameters=_parameters, rules=BlockRules(forward="llama", router_cast=True),
                  peft_default=False, compiled_rules=True,  # with estimate/rules_compiled_moe.py's MLP
                  **LLAMA_NAMES, config=ConfigSchema(
                      config_class="Qwen3MoeConfig", read=_read, required=_SIZES, aliases={"num_local_experts": "num_experts"},
                      fixed={"qk_norm": True}, keys={"num_experts": "num_experts", "top_k": "num_experts_per_tok",
                                                     "expert_ffn_size": "moe_intermediate_size"},
                      defaults={"vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 6144,
                                "num_hidden_layers": 24, "num_attention_heads": 32, "num_key_value_heads": 4,
                                "head_dim": None, "hidden_act": "silu", "tie_word_embeddings": False,
                                "attention_bias": False, "attention_dropout": 0.0, "use_sliding_window": False,
                                "sliding_window": 4096, "max_window_layers": 28, "layer_types": None,
                                "decoder_sparse_step": 1, "moe_intermediate_size": 768, "num_experts_per_tok": 8,
                                "num_experts": 128, "norm_topk_prob": False, "mlp_only_layers": None,
                                "output_router_logits": False}))
