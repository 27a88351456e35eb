"""The module layouts of the ``reference`` and ``megatron`` profiles, which name modules their
own way whatever the family (``models/reference.py``, ``estimate/rules_megatron.py``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from trainmem.families import layout as lay
from trainmem.families.base import NameScheme, TPRoles, register_scheme
from trainmem.families.buffers import Buffer, rotary_width

if TYPE_CHECKING:  # pragma: no cover
    from trainmem.specs.model import ModelSpec


def reference_parameters(m: "ModelSpec") -> lay.Params:
    """``named_parameters()`` of trainmem's reference decoder (``models/reference.py`` ``_build``):
    ``embed``, ``pos_embed``, per block ``attn_norm``, ``attn.{q,k,v,o}``, ``mlp_norm``,
    ``mlp.{gate,up,down}``; ``norm``; ``lm_head`` unless tied to ``embed``."""
    H, F = m.hidden_size, m.ffn_size
    params = lay.embedding("embed", m.vocab_size, H)
    if m.max_positions:
        params += lay.embedding("pos_embed", m.max_positions, H)
    for i in range(m.num_layers):
        pre = f"layers.{i}"
        params += lay.norm(m, f"{pre}.attn_norm")
        params += lay.linear(f"{pre}.attn.q", m.q_size, H, m.qkv_bias)
        params += lay.linear(f"{pre}.attn.k", m.kv_size, H, m.qkv_bias)
        params += lay.linear(f"{pre}.attn.v", m.kv_size, H, m.qkv_bias)
        params += lay.linear(f"{pre}.attn.o", H, m.q_size, m.out_bias)
        params += lay.norm(m, f"{pre}.mlp_norm")
        if m.gated:
            params += lay.linear(f"{pre}.mlp.gate", F, H, m.mlp_bias)
        params += lay.linear(f"{pre}.mlp.up", F, H, m.mlp_bias)
        params += lay.linear(f"{pre}.mlp.down", H, F, m.mlp_bias)
    params += lay.norm(m, "norm")
    return params + ([] if m.tied_embeddings else lay.linear("lm_head", m.vocab_size, H, False))


def _inv_freq(name: str):
    """One ``inv_freq`` (rot/2 fp32) unless positions are learned: ``models/reference.py``'s
    ``register_buffer("inv_freq", ...)``; Megatron-core's ``RotaryEmbedding.inv_freq`` (a plain
    device tensor, ``rotary_pos_embedding.py``)."""
    def buffers(m: "ModelSpec") -> tuple[Buffer, ...]:
        return () if m.max_positions else (Buffer(name, ((rotary_width(m) + 1) // 2,), (), "float32"),)
    return buffers


@register_scheme
def reference() -> NameScheme:
    return NameScheme(name="reference", embeddings=("embed", "pos_embed"), head=("norm", "lm_head"),
                      layers="layers", tp=TPRoles(column=("attn.q", "attn.k", "attn.v", "mlp.gate", "mlp.up"),
                                                  row=("attn.o", "mlp.down"), vocab=("embed.weight",)),
                      parameters=reference_parameters, buffers=_inv_freq("inv_freq"))


@register_scheme
def megatron() -> NameScheme:
    # Megatron-LM GPTModel: embedding, decoder.layers[i], decoder.final_layernorm, output_layer
    return NameScheme(name="megatron", embeddings=("embedding",), head=("final_layernorm", "output_layer"),
                      layers="layers", buffers=_inv_freq("rotary_pos_emb.inv_freq"))
