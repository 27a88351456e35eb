"""OLMo-2 (``modeling_olmo2.py``, transformers 5.x): a Llama decoder with post-norms (RMSNorm on the
attention and MLP outputs, before each residual add; none before them), q/k RMSNorm over the whole
projection, and ``Olmo2RMSNorm`` (``(w * normed).to(dtype)``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from trainmem.families import layout as lay
from trainmem.families.base import BlockRules, ConfigSchema, Family, register_family
from trainmem.families.llama import LLAMA_NAMES
from trainmem.families.moe_layout import dense_mlp

if TYPE_CHECKING:  # pragma: no cover
    from trainmem.specs.model import ModelSpec


def _parameters(m: "ModelSpec") -> lay.Params:
    """``named_parameters()`` of ``Olmo2ForCausalLM``: no input norm; q/k norms as wide as q and k."""
    H = m.hidden_size
    params = lay.embedding("model.embed_tokens", m.vocab_size, H)
    for i in range(m.num_layers):
        pre, at = f"model.layers.{i}", f"model.layers.{i}.self_attn"
        params += lay.linear(f"{at}.q_proj", m.q_size, H, m.qkv_bias)
        params += lay.linear(f"{at}.k_proj", m.kv_size, H, m.qkv_bias)
        params += lay.linear(f"{at}.v_proj", m.kv_size, H, m.qkv_bias)
        params += lay.linear(f"{at}.o_proj", H, m.q_size, m.out_bias)
        params += lay.norm(m, f"{at}.q_norm", m.q_size) + lay.norm(m, f"{at}.k_norm", m.kv_size)
        params += dense_mlp(f"{pre}.mlp", m.ffn_size, H)
        params += lay.norm(m, f"{pre}.post_attention_layernorm") + lay.norm(m, f"{pre}.post_feedforward_layernorm")
    params += lay.norm(m, "model.norm")
    return params + lay.lm_head(m)


@register_family
def olmo2() -> Family:
    # peft 0.21.2 maps no "olmo2": q_proj, v_proj (peft's usual pair) are adapted, with a note
    return Family(name="olmo2", parameters=_parameters, rules=BlockRules(forward="llama", post_norms=True, rope_fp32=True),
                  peft_default=False, compiled_rules=True, compiled_narrow=True,  # estimate/rules_compiled_olmo2.py
                  **LLAMA_NAMES, config=ConfigSchema(
                      config_class="Olmo2Config", fixed={"qk_norm": True},
                      defaults={"vocab_size": 50304, "hidden_size": 4096, "intermediate_size": 11008,
                                "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": None,
                                "head_dim": None, "hidden_act": "silu", "tie_word_embeddings": False,
                                "attention_bias": False, "attention_dropout": 0.0}))
