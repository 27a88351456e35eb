"""Layer kinds: which blocks of a Hugging Face model are alike, read off the model itself.

The model is built from its config on the meta device (no memory, exact shapes). A block's
signature is what could change what it saves: every submodule's class and plain attributes
(``is_sliding``, ``sliding_window``, ``use_rope``, ``layer_type`` ...; ``layer_idx`` left out),
every parameter's name, shape and dtype, and whether the block runs checkpointed. Blocks with one
signature are one kind. The traced model is the shortest prefix of blocks that shows every kind,
plus one block more (it must repeat its kind's first block exactly, which checks the kinds).

An encoder-decoder (T5, BART) has two stacks, each a ``ModuleList`` as long as its own depth key
(``num_layers`` / ``num_decoder_layers``, ``encoder_layers`` / ``decoder_layers``): each stack has
its own kinds and its own cut, and both are cut in one config.

Known limitations:
  - A decoder or encoder has one stack of blocks (a ``ModuleList`` as long as ``num_hidden_layers``).
  - An encoder-decoder's blocks are counted from the encoder's first under ``--recompute every-k``
    (``trace/step.py`` ``_enable_recompute``); a cut changes that count, so every-k is refused there.
  - The prefix is cut from the config by ``num_hidden_layers`` and by per-layer lists (any list
    as long as the model is deep, e.g. ``layer_types``; index lists such as ``mlp_only_layers``
    are filtered). When the cut model's blocks do not have the full model's signatures, the cut
    is refused rather than guessed.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Callable, Mapping

from trainmem.errors import UnsupportedError
from trainmem.models.hf import tp_plan_of  # noqa: F401 - kept importable here (K.tp_plan_of)

__all__ = ["Stack", "find_stack", "find_stacks", "layer_signatures", "reduced_config", "reduced_stacks_config",
           "meta_model", "parameter_shapes_of", "layer_count_key"]

_SKIP_ATTRS = {"training", "layer_idx", "layer_id", "layer_number", "block_idx", "idx", "layer_index"}


@dataclass(frozen=True)
class Stack:
    """The blocks of a model: their ``ModuleList``'s name (``model.layers``) and count."""

    prefix: str  # "model.layers."
    num_layers: int
    count_key: str = ""  # an encoder-decoder's: the config key of this stack's depth ("num_decoder_layers")


def meta_model(config: Mapping[str, Any], attention: str, dtype=None):
    """The model ``config`` describes, on the meta device, weights not initialized."""
    import torch

    from trainmem.models.hf import build_hf_model
    from trainmem.trace.torch_state import default_dtype

    ctx = default_dtype(dtype) if dtype is not None else contextlib.nullcontext()
    with torch.device("meta"), ctx:
        return build_hf_model(config, attention=attention, init_weights=False)


def find_stack(model) -> Stack:
    """The one ``ModuleList`` of blocks: as long as ``config.num_hidden_layers``."""
    import torch

    depth = getattr(model.config, "num_hidden_layers", None)
    found = [name for name, m in model.named_modules()
             if isinstance(m, torch.nn.ModuleList) and depth and len(m) == depth]
    if len(found) != 1:
        what = "no" if not found else f"{len(found)} ({', '.join(found)})"
        raise UnsupportedError(f"{type(model).__name__}: --profile traced needs one stack of blocks "
                               f"(a ModuleList of num_hidden_layers={depth}); found {what}")
    return Stack(found[0] + ".", depth)


def find_stacks(model) -> tuple[Stack, ...]:
    """Every stack of blocks: :func:`find_stack`'s one, or an encoder-decoder's two (an outermost
    ``ModuleList`` as long as a depth key of the config; the decoder's key names the decoder)."""
    import torch

    if not getattr(model.config, "is_encoder_decoder", False):
        return (find_stack(model),)
    cfg = model.config.to_dict()
    depths = {k: v for k, v in cfg.items() if k.endswith("layers") and isinstance(v, int)
              and not isinstance(v, bool) and v > 0}
    lists = [n for n, m in model.named_modules() if isinstance(m, torch.nn.ModuleList) and len(m) in depths.values()]
    lists = [n for n in lists if not any(n.startswith(o + ".") for o in lists)]  # not a block's own list
    stacks = []
    for name in lists:
        dec = "decoder" in name.split(".")
        keys = [k for k, v in depths.items() if v == len(model.get_submodule(name)) and ("decoder" in k) == dec
                and not k.startswith("num_hidden")]
        if len(keys) == 1:
            stacks.append(Stack(name + ".", depths[keys[0]], keys[0]))
    if len(stacks) != 2 or len({s.count_key for s in stacks}) != 2:
        raise UnsupportedError(f"{type(model).__name__}: --profile traced needs an encoder and a decoder stack, each a "
                               f"ModuleList as long as a depth key of the config ({', '.join(depths) or 'none'}); "
                               f"found {', '.join(s.prefix[:-1] for s in stacks) or 'none'}")
    return tuple(stacks)


def _plain(value) -> bool:
    return value is None or isinstance(value, (bool, int, float, str))


def layer_signatures(model, stack: Stack, checkpointed: Callable[[int], bool]) -> list[tuple]:
    """One hashable signature per block (see the module docstring)."""
    layers = model.get_submodule(stack.prefix[:-1])
    out = []
    for i, layer in enumerate(layers):
        mods = tuple((n, type(m).__name__, tuple(sorted((k, v) for k, v in vars(m).items()
                                                         if not k.startswith("_") and k not in _SKIP_ATTRS
                                                         and _plain(v))))
                     for n, m in layer.named_modules())
        params = tuple((n, tuple(p.shape), str(p.dtype)) for n, p in layer.named_parameters())
        out.append((mods, params, bool(checkpointed(i))))
    return out


def layer_count_key(config: Mapping[str, Any]) -> str:
    """The key this config writes its depth under (``n_layer`` for gpt2)."""
    from transformers import AutoConfig

    aliases = getattr(type(AutoConfig.for_model(config["model_type"])), "attribute_map", {}) or {}
    for key, target in aliases.items():
        if target == "num_hidden_layers" and key in config:
            return key
    return "num_hidden_layers"


def reduced_config(config: Mapping[str, Any], depth: int, layers: int) -> dict:
    """``config`` cut to its first ``layers`` blocks (of ``depth``)."""
    out = dict(config)
    out[layer_count_key(config)] = layers
    for key, value in config.items():
        if not isinstance(value, list):
            continue
        if len(value) == depth and depth != layers:
            out[key] = value[:layers]  # per-layer lists: layer_types, no_rope_layers, ...
        elif key.endswith("_layers") and all(isinstance(v, int) and not isinstance(v, bool) for v in value):
            out[key] = [v for v in value if v < layers]  # index lists: mlp_only_layers, ...
    return out


def reduced_stacks_config(config: Mapping[str, Any], stacks: tuple[Stack, ...], cuts: tuple[int, ...]) -> dict:
    """An encoder-decoder's ``config`` cut to the first ``cuts[i]`` blocks of ``stacks[i]``: each
    depth key written (T5 reads a missing ``num_decoder_layers`` as ``num_layers``), its aliases
    dropped (``num_hidden_layers`` for T5's ``num_layers``)."""
    from transformers import AutoConfig

    if len(stacks) == 1:
        return reduced_config(config, stacks[0].num_layers, cuts[0])
    aliases = getattr(type(AutoConfig.for_model(config["model_type"])), "attribute_map", {}) or {}
    out = dict(config)
    for stack, cut in zip(stacks, cuts):
        for alias, target in aliases.items():
            if target == stack.count_key:
                out.pop(alias, None)
        out[stack.count_key] = cut
    return out


def parameter_shapes_of(model) -> list[tuple[str, tuple[int, ...]]]:
    """``named_parameters()`` as (name, shape): tied weights once, as transformers names them."""
    return [(n, tuple(p.shape)) for n, p in model.named_parameters() if p.requires_grad]


