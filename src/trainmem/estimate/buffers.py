"""The model's registered buffers as ``buffer`` items: resident all step, in every phase.

The family registry declares them (:attr:`trainmem.families.base.Family.buffers`,
``families/buffers.py``: rotary ``inv_freq``/``original_inv_freq``, ceil(rot/2) fp32 values each;
BERT's position and token-type ids; Gemma's embedding scale; DeepSeek-V3's router bias); here they
become items named as ``named_buffers()`` names them, so an estimate and a trace (which files every
``named_buffers()`` tensor under ``buffer``: ``trace/model_states.py`` ``register_states``) join per
buffer. Bytes are logical (elements × item size). The same items under every profile (hf, traced,
compiled rules): a buffer is never an activation.

Under pipeline parallelism a buffer sits on the stage that holds its module: a block's on the
block's stage, the embedding's on the first, the rotary module's on every stage (each stage
computes its own RoPE tables: ``estimate/parallel.py``). Tensor and expert parallelism replicate
them (their sizes do not depend on the split).
"""

from __future__ import annotations

import math

from trainmem.estimate.symbols import formula
from trainmem.estimate.torchtune_loop import torchtune_loop_items
from trainmem.families import family_of, get_scheme
from trainmem.families.buffers import PARAM_DTYPE
from trainmem.inventory import Category, Inventory, MemoryItem, dtype_bytes
from trainmem.names import layer_of

__all__ = ["buffer_items", "buffer_inventory", "stage_buffers"]


def buffer_items(model, step, profile: str = "hf") -> list[MemoryItem]:
    """The buffers ``model``'s family registers (the ``reference``/``megatron`` profiles': their own
    model's), in the dtype the step builds them in."""
    scheme = get_scheme(profile)
    declared = scheme.buffers if scheme is not None and scheme.buffers is not None else family_of(model).buffers
    if profile == "traced":  # an unmapped model type's own named_buffers(), not the generic family's guess
        from trainmem.estimate.traced.buffers import traced_buffers
        declared = traced_buffers
    out = []
    for b in declared(model):
        dt = step.dtypes.param if b.dtype == PARAM_DTYPE else b.dtype
        size = dtype_bytes(dt)
        out.append(MemoryItem.make(b.name, Category.BUFFER, b.shape, dt, int(math.prod(b.shape) * size),
                                   formula(b.dims, size) if b.dims else f"{math.prod(b.shape) * size:g}", b.dims))
    return out + torchtune_loop_items(step)  # resident all step too: torchtune's ignore_labels_cache


def buffer_inventory(model, step, profile: str = "hf") -> Inventory:
    return Inventory(buffer_items(model, step, profile))


def stage_buffers(items: list[MemoryItem], stage: int, first_layer: int, end_layer: int) -> list[MemoryItem]:
    """The buffers pipeline stage ``stage`` (blocks ``first_layer`` to ``end_layer``) holds: a block's
    if the block is there, the others (embedding's, rotary tables') on the first stage, the rotary
    module's on every stage."""
    out = []
    for it in items:
        li = layer_of(it.name)
        if li is not None:
            keep = first_layer <= li < end_layer
        else:
            keep = stage == 0 or ".rotary_emb." in it.name
        if keep:
            out.append(it)
    return out
