"""GPT-BigCode (``modeling_gpt_bigcode.py``: SantaCoder, StarCoder): GPT-2's block with ``nn.Linear``
projections (weights ``[out, in]``), a packed ``c_attn`` of width ``H + 2·kv_dim`` and, with
``multi_query`` (the default), multi-query attention: one K/V head (``GPTBigCodeAttention.__init__``:
``kv_heads = 1 if multi_query else num_heads``). Learned positions; the model keeps a causal ``bias``
buffer (``GPTBigCodeModel.__init__``), unused by its 5.24 forward (masks come from ``masking_utils``)."""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

from trainmem.families import layout as lay
from trainmem.families.base import BlockRules, Family, register_family
from trainmem.families.buffers import Buffer
from trainmem.families.config import ConfigReader
from trainmem.families.gpt2 import _read as _gpt2_read, gpt2

if TYPE_CHECKING:  # pragma: no cover
    from trainmem.specs.model import ModelSpec


def _parameters(m: "ModelSpec") -> lay.Params:
    lay.refuse(m, "MoE", "qk_norm", "type_vocab_size")
    H, F = m.hidden_size, m.ffn_size
    params = lay.embedding("transformer.wte", m.vocab_size, H)
    params += lay.embedding("transformer.wpe", m.max_positions, H)
    for i in range(m.num_layers):
        pre = f"transformer.h.{i}"
        params += lay.norm(m, f"{pre}.ln_1")
        params += lay.linear(f"{pre}.attn.c_attn", m.q_size + 2 * m.kv_size, H, m.qkv_bias)
        params += lay.linear(f"{pre}.attn.c_proj", H, m.q_size, m.out_bias)
        params += lay.norm(m, f"{pre}.ln_2")
        params += lay.linear(f"{pre}.mlp.c_fc", F, H, m.mlp_bias)
        params += lay.linear(f"{pre}.mlp.c_proj", H, F, m.mlp_bias)
    params += lay.norm(m, "transformer.ln_f")
    return params + lay.lm_head(m)


def _buffers(m: "ModelSpec") -> tuple[Buffer, ...]:
    """``GPTBigCodeModel.bias``: ``tril(ones(P, P, dtype=bool))`` over ``max_position_embeddings``."""
    P = m.max_positions
    return (Buffer("transformer.bias", (P, P), (str(P), str(P)), "bool"),)


def _read(c: ConfigReader) -> dict:
    # GPTBigCodeConfig.__post_init__: num_key_value_heads = 1 if multi_query else n_head
    return {**_gpt2_read(c), "num_kv_heads": 1 if c("multi_query") else c("n_head")}


@register_family
def gpt_bigcode() -> Family:
    """GPT-2's declarations (config keys, module paths, TP roles, heads, peft's ``c_attn``) with its differences."""
    base = gpt2()
    config = replace(base.config, config_class="GPTBigCodeConfig", read=_read,
                     defaults={**base.config.defaults, "activation_function": "gelu_pytorch_tanh", "multi_query": True})
    # GPTBigCodeFor{Sequence,Token}Classification: GPT-2's score and classifier; peft 0.21.2: "gpt_bigcode": ["c_attn"]
    return replace(base, name="gpt_bigcode", config=config, parameters=_parameters,
                   rules=BlockRules(forward="gpt_bigcode"), conv1d=False, compiled_rules=False, buffers=_buffers)
