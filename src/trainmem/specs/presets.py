"""The bundled model presets: which engine covers each, where its config.json came from, and its
parameter counts (total and, for mixture-of-experts models, active per token).

A preset is estimated by the hand-written ``hf`` rules when the estimator maps its ``model_type`` and has
rules for each of its layer kinds (an estimate runs); any other preset is covered by ``--profile traced``
and ``trainmem trace``, which build the transformers model from the same file.

Counts are exact integers:
  - ``estimate``: the estimator's own parameter layout (``estimate/params.py`` ``parameter_shapes``),
    which a test holds equal to transformers' ``named_parameters()``;
  - ``transformers``: the transformers model built on the meta device (no memory, no download), for
    presets the estimator cannot count yet (``count_meta=True``; needs torch and transformers).

Known limitations:
  - Active parameters count every parameter outside the routed experts plus ``top_k / E`` of the routed
    experts' stacked weights (transformers 5.x keeps one ``[E, ...]`` tensor per projection under a
    module named ``experts``); shared experts, routers and attention count whole.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable, Mapping

from trainmem.errors import UnsupportedError
from trainmem.specs.loaders import list_presets, load_config_dict, load_model

__all__ = ["PresetInfo", "preset_engine", "estimated_presets", "active_parameters", "meta_parameter_shapes",
           "preset_info", "preset_infos"]

#: config keys that name the routed experts per MoE layer, first present wins
_EXPERT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")


@dataclass(frozen=True, kw_only=True)
class PresetInfo:
    name: str
    model_type: str
    engine: str
    """``estimate`` (the hf rules, ``--profile traced`` and ``trace`` too) or ``traced`` (``--profile traced``
    and ``trace`` only: the estimator does not map this model type yet)."""
    source: str
    """The ``_source`` the preset file names (Hugging Face repo id, revision, where the fields were read)."""
    num_parameters: int | None = None
    num_active_parameters: int | None = None
    """Per token, for MoE presets; None for dense ones."""
    counted_by: str | None = None
    """``estimate`` or ``transformers`` (meta device); None when not counted."""

    def to_dict(self) -> dict:
        return {k: getattr(self, k) for k in ("name", "model_type", "engine", "source", "num_parameters",
                                              "num_active_parameters", "counted_by")}


def _spec(name: str):
    """The preset's ModelSpec, or None when the estimator does not map its model type or options."""
    try:
        return load_model(name)
    except UnsupportedError:
        return None


def preset_engine(name: str) -> str:
    """``estimate`` when the hf rules estimate the preset (a short step runs: milliseconds), else ``traced``."""
    from trainmem.estimate import estimate
    from trainmem.specs import StepSpec

    model = _spec(name)
    if model is None:
        return "traced"
    try:
        estimate(model, StepSpec(batch=1, seq=16))
    except UnsupportedError:  # e.g. a layer kind without hand-written rules
        return "traced"
    return "estimate"


def estimated_presets() -> list[str]:
    """The presets the estimator's hf rules cover (every command runs on them at its defaults)."""
    return [n for n in list_presets() if preset_engine(n) == "estimate"]


def active_parameters(shapes: Iterable[tuple[str, tuple[int, ...]]], num_experts: int, top_k: int) -> int:
    """Parameters one token runs through: the routed experts' stacked ``[E, ...]`` tensors count
    ``top_k / E``, everything else whole (shared experts are a module named ``shared_expert(s)``)."""
    total = 0
    for name, shape in shapes:
        n = math.prod(shape)
        if "experts" in name.split(".")[:-1] and shape and shape[0] == num_experts:
            total += n // num_experts * top_k  # (E, ...) -> top_k of the E slices
        else:
            total += n
    return total


def _experts(config: Mapping) -> tuple[int, int]:
    experts = next((config[k] for k in _EXPERT_KEYS if isinstance(config.get(k), int) and config[k] > 0), 0)
    return experts, (config.get("num_experts_per_tok") or 0) if experts else 0


def meta_parameter_shapes(config: Mapping) -> list[tuple[str, tuple[int, ...]]]:
    """``named_parameters()`` of the causal-LM transformers builds from ``config`` on the meta device
    (``models/hf.py`` ``build_hf_model``: no download, no remote code; tied weights once)."""
    import torch

    from trainmem.models.hf import build_hf_model

    with torch.device("meta"):
        model = build_hf_model({k: v for k, v in config.items() if not k.startswith("_")},
                               attention="eager", init_weights=False)  # parameters do not depend on the kernel
    return [(n, tuple(p.shape)) for n, p in model.named_parameters()]


def preset_info(name: str, *, count_meta: bool = False) -> PresetInfo:
    """One preset's engine, source and counts (``count_meta``: count a preset the estimator does not
    map from transformers' meta-device model)."""
    from trainmem.estimate.params import parameter_shapes

    config = load_config_dict(name)
    base = dict(name=name, model_type=config["model_type"], engine=preset_engine(name),
                source=str(config.get("_source", "")))
    model = _spec(name)
    if model is not None:  # the estimator's layout, also where its activation rules are missing
        shapes, (experts, top_k), by = parameter_shapes(model), (model.num_experts, model.top_k), "estimate"
    elif count_meta:
        shapes, (experts, top_k), by = meta_parameter_shapes(config), _experts(config), "transformers"
    else:
        return PresetInfo(**base)
    total = sum(math.prod(s) for _, s in shapes)
    active = active_parameters(shapes, experts, top_k) if experts else None
    return PresetInfo(**base, num_parameters=total, num_active_parameters=active, counted_by=by)


def preset_infos(*, count_meta: bool = False) -> list[PresetInfo]:
    return [preset_info(n, count_meta=count_meta) for n in list_presets()]
