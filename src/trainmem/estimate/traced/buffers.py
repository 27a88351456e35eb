"""``--profile traced``: the registered buffers of a model type the estimator does not map, read off the model.

A mapped family declares its buffers (``families/buffers.py``, each declaration checked against a real
build by tests/families/test_family_buffers.py); those stand. An unmapped model type's spec is the
``generic`` family, whose declaration is a guess (Llama's rotary pair), wrong for most such models:
DeBERTa-v2 registers ``position_ids`` and no rotary table; MiniMax registers per lightning-attention
block ``slope_rate``, ``query_decay``, ``key_decay`` and a (1, heads, block, block) ``diagonal_decay``
(transformers ``modeling_minimax.py`` ``MiniMaxLightningAttention.__init__``), 1 MiB in fp32 at four
heads. Autograd saves slices of them, and the traced activations leave buffers out (traced/record.py
``_one``): they are buffer items, resident all step, as ``trainmem trace`` files every ``named_buffers()``
tensor (``trace/model_states.py`` ``register_states``). So they are read here from the model itself:
``named_buffers()`` of the full-depth model built on the meta device (exact shapes, no memory), built
twice, under fp32 and bf16 default dtypes: a buffer whose dtype follows the default is made in the
parameters' dtype (:data:`~trainmem.families.buffers.PARAM_DTYPE`), any other keeps its own.
"""

from __future__ import annotations

import json
from functools import lru_cache
from typing import TYPE_CHECKING

from trainmem.families import family_of
from trainmem.families.buffers import PARAM_DTYPE, Buffer

if TYPE_CHECKING:  # pragma: no cover
    from trainmem.specs.model import ModelSpec

__all__ = ["traced_buffers"]


def traced_buffers(model: "ModelSpec") -> tuple[Buffer, ...]:
    """The buffers of ``model`` under ``--profile traced``: its family's declaration, or, for a model
    type the estimator does not map (the ``generic`` family), the model's own ``named_buffers()``."""
    family = family_of(model)
    if family.config is not None:  # a mapped model type (only ``generic`` reads no config)
        return family.buffers(model)
    from trainmem.estimate.traced import _config_of

    return _read(json.dumps(_config_of(model), sort_keys=True))


@lru_cache(maxsize=32)
def _read(config_json: str) -> tuple[Buffer, ...]:
    import torch

    from trainmem.estimate.traced.kinds import meta_model

    config = json.loads(config_json)
    # eager: every model type has it (DeBERTa-v2 has no SDPA path); buffers do not depend on the kernel
    full, half = ({n: b for n, b in meta_model(config, "eager", dtype).named_buffers()}
                  for dtype in (torch.float32, torch.bfloat16))
    return tuple(Buffer(name, tuple(b.shape), (), PARAM_DTYPE if half[name].dtype != b.dtype
                        else str(b.dtype).removeprefix("torch.")) for name, b in full.items())
