"""The module layouts of the ``reference`` and ``megatron`` profiles, which name modules their
own way whatever the family (``models/reference.py``, ``estimate/rules_megatron.py``)."""

from __future__ import annotations

from trainmem.families.base import NameScheme, TPRoles, register_scheme


@register_scheme
def reference() -> NameScheme:
    # trainmem/models/reference.py: Reference.embed, pos_embed, layers[i].attn.{q,k,v,o},
    # layers[i].mlp.{gate,up,down}, norm, lm_head
    return NameScheme(name="reference", embeddings=("embed", "pos_embed"), head=("norm", "lm_head"),
                      layers="layers", tp=TPRoles(column=("attn.q", "attn.k", "attn.v", "mlp.gate", "mlp.up"),
                                                  row=("attn.o", "mlp.down"), vocab=("embed.weight",)))


@register_scheme
def megatron() -> NameScheme:
    # Megatron-LM GPTModel: embedding, decoder.layers[i], decoder.final_layernorm, output_layer
    return NameScheme(name="megatron", embeddings=("embedding",), head=("final_layernorm", "output_layer"),
                      layers="layers")
