"""gpt-oss (``modeling_gpt_oss.py``): sliding and full attention blocks alternating (``layer_types``),
a learned sink logit per head (``self_attn.sinks``), biased q/k/v/o, and an MoE MLP in every block
(a biased ``router``, fused ``(E, H, 2F)`` experts with biases). Its ``hf`` rules live in
``estimate/rules_gpt_oss.py`` (eager attention only: transformers gives gpt-oss no SDPA path)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from trainmem.families import layout as lay
from trainmem.families.base import BlockRules, ConfigSchema, Family, register_family
from trainmem.families.config import MOE_KEYS, ConfigReader
from trainmem.families.kinds import from_layer_types, pattern_types
from trainmem.families.llama import LLAMA_NAMES
from trainmem.families.moe_layout import attention, experts, kind_blocks

if TYPE_CHECKING:  # pragma: no cover
    from trainmem.specs.layer_kind import LayerKind
    from trainmem.specs.model import ModelSpec


def _read(c: ConfigReader) -> dict:
    L = c("num_hidden_layers")
    # GptOssForCausalLM adds load_balancing_loss_func's loss too; only Qwen3-MoE's and Mixtral's are modelled
    c.refuse_if("output_router_logits", "the load-balancing loss is modelled for qwen3_moe and mixtral only "
                                        "(estimate/rules_hf_moe.py)")
    return {"layer_kinds": from_layer_types(c, pattern_types(c, 2), window=c("sliding_window"), moe=[True] * L)}


def _parameters(m: "ModelSpec") -> lay.Params:
    H = m.hidden_size

    def block(pre: str, kind: "LayerKind") -> lay.Params:
        at = f"{pre}.self_attn"
        p: lay.Params = [(f"{at}.sinks", (m.num_heads,))] + attention(at, m)
        return p + lay.linear(f"{pre}.mlp.router", m.num_experts, H, True) + experts(f"{pre}.mlp.experts", m,
                                                                                    in_major=True, bias=True)

    return kind_blocks(m, block)


@register_family
def gpt_oss() -> Family:
    # peft 0.21.2 maps no "gpt_oss": q_proj, v_proj (peft's usual pair) are adapted, with a note
    return Family(name="gpt_oss", parameters=_parameters, rules=BlockRules(forward="gpt_oss"), **LLAMA_NAMES,
                  peft_default=False,
                  # GptOssPreTrainedModel: _supports_sdpa = False (the sinks); its flash is a hub kernel (sinks
                  # passed in) that rules_gpt_oss does not model: eager is the one kernel estimated
                  attentions=("eager",),
                  config=ConfigSchema(
                      config_class="GptOssConfig", read=_read, keys=MOE_KEYS,
                      fixed={"mlp_bias": True, "attn_sinks": True},
                      required=("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                                "intermediate_size", "num_local_experts", "num_experts_per_tok"),
                      defaults={"vocab_size": 201088, "hidden_size": 2880, "intermediate_size": 2880,
                                "num_hidden_layers": 36, "num_attention_heads": 64, "num_key_value_heads": 8,
                                "head_dim": 64, "hidden_act": "silu", "tie_word_embeddings": False,
                                "attention_bias": True, "attention_dropout": 0.0, "sliding_window": 128,
                                "layer_types": None, "num_local_experts": 128, "num_experts_per_tok": 4,
                                "output_router_logits": False}))
