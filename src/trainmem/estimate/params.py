"""Every trainable parameter of a :class:`ModelSpec`: its Hugging Face name and exact shape.

The list matches ``[(n, tuple(p.shape)) for n, p in model.named_parameters()]`` of the model
``trainmem.models.hf.build_hf_model`` builds (transformers 5.x; causal-LM head, masked-LM head for
``bert``): same names, same order, tied weights once under the embedding's name. Each family's
layout is its :attr:`Family.parameters <trainmem.families.base.Family.parameters>` (``trainmem/families/``);
family ``generic``, and the ``llama``-like families, use Llama names.

Known limitations:
  - Names follow transformers 5.x module layouts (e.g. Mixtral experts as fused 3-D
    ``experts.gate_up_proj``; GPT-NeoX's head as ``lm_head``). 4.x names differ; shapes and counts do not.
  - Spec features a family's HF code does not have are still counted, with the nearest name
    (a gated MLP in ``gpt2``/``gpt_neox``/``bert`` is one packed ``[2F, H]`` up-projection);
    features with no sensible name there (MoE, QK-norm, extra embeddings) raise ``UnsupportedError``.
"""

from __future__ import annotations

import re
from math import prod
from typing import Callable

from trainmem.families import family_of, get_scheme
from trainmem.specs.model import ModelSpec

__all__ = ["Shape", "parameter_shapes", "count_parameters", "kept_fp32"]

Shape = tuple[int, ...]


def parameter_shapes(model: ModelSpec, profile: str = "hf") -> list[tuple[str, Shape]]:
    """``(name, shape)`` of every trainable parameter, in ``named_parameters()`` order; under a
    profile that runs its own model (``reference``), that model's parameters and names."""
    scheme = get_scheme(profile)
    if scheme is not None and scheme.parameters is not None:
        return scheme.parameters(model)
    from trainmem.estimate.heads import head_parameters  # a classification head replaces the LM head
    return head_parameters(model, family_of(model).parameters(model))


def count_parameters(model: ModelSpec) -> int:
    """Number of trainable scalars; tied weights count once."""
    return sum(prod(shape) for _, shape in parameter_shapes(model))


def kept_fp32(model: ModelSpec, profile: str = "hf") -> Callable[[str], bool] | None:
    """Which parameters a 16-bit load keeps in fp32: the family's ``fp32_params`` (its model class's
    ``_keep_in_fp32_modules_strict``), matched as transformers matches them -- each entry a regular
    expression searched in the name, ``*`` as ``.*`` (``core_model_loading.build_glob_alternation``,
    applied by ``modeling_utils.PreTrainedModel._get_dtype_plan``); None when it keeps none or the
    profile runs its own model."""
    scheme = get_scheme(profile)
    if scheme is not None and scheme.parameters is not None:
        return None
    frags = family_of(model).fp32_params
    if not frags:
        return None
    pattern = re.compile("|".join(f"(?:{f.replace('*', '.*')})" for f in frags))
    return lambda name: pattern.search(name) is not None
