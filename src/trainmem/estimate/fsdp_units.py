"""FSDP2 unit layout: the token embedding and the head as their own ``fully_shard`` units.

``ParallelSpec.fsdp_units``: ``blocks`` wraps each decoder block and leaves the rest (token
embedding, final norm, output layer) in the root, which FSDP2 never reshards after forward
(``FSDPState._lazy_init`` clears the root's ``post_forward_mesh_info``): gathered all step.
``blocks+embed+head`` also wraps the token embedding, and the final norm with the output layer,
as units of their own, as

* torchtitan's ``apply_fsdp`` (torchtitan/models/llama3/infra/parallelize.py) does always:
  ``fully_shard(model.tok_embeddings)``, each block, ``fully_shard([model.norm, model.output])``,
  then the root (which then holds no parameter of its own);
* torchtune's ``shard_model`` (torchtune/training/_distributed.py) does for the modules named in
  ``custom_sharded_layers`` (its 70B configs: ``['tok_embeddings', 'output']``; the final norm, H
  elements, stays in the root there: the estimate puts it with the output layer, a difference of
  H × 2 bytes).

Each such unit is gathered only around its own forward and backward and resharded after
(``FSDPParamGroup.post_forward`` / ``post_backward``, torch/distributed/fsdp/_fully_shard/
_fsdp_param_group.py). What a unit holds gathered while it runs (torch 2.13):

* ``FSDPParamGroup.wait_for_unshard``: the flat all-gather output is copied out into each
  parameter's ``all_gather_outputs``; in forward its free is deferred to the next all-gather
  (``comm_ctx.all_gather_state``), in backward it is freed after the copy-out: a unit runs its
  forward with 2 × its gathered size alive, and its backward with its gathered size plus the flat
  buffer of the unit prefetched for the next backward (``FSDPState._pre_backward`` ->
  ``_backward_prefetch``: the unit before it in forward order) or, during the copy-out, its own;
* the head runs at the end of forward (the logits) and first in backward, prefetching the last
  block; the first block's backward prefetches the embedding; the embedding's backward is the last.
"""

from __future__ import annotations

from trainmem.names import is_head, is_token_embedding

__all__ = ["FSDP_UNITS", "separate_unit", "unit_gathered"]

FSDP_UNITS = ("blocks", "blocks+embed+head")


def separate_unit(name: str, units: str) -> str | None:
    """``embed`` or ``head`` for a root parameter that ``units`` wraps as its own unit, else None."""
    if units == "blocks":
        return None
    if is_token_embedding(name):
        return "embed"
    return "head" if is_head(name) else None


def unit_gathered(*, block: float, embed: float, head: float, tied: bool) -> dict[str, float]:
    """Per phase, the most gathered bytes of the blocks and the two separate units together
    (``block``: the largest block's gathered bytes; ``embed``/``head``: the units'). With tied
    embeddings the output layer's weight is the embedding unit's: gathered with it for the head."""
    if tied:
        head += embed
    return {"forward": max(2 * block, 2 * head),
            "backward_start": max(2 * head, head + block),
            "backward": max(2 * block, block + embed),
            "backward_end": 2 * embed}
