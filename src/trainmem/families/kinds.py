"""Layer kinds from a ``config.json``: which blocks are sliding, chunked or linear, dense or MoE.

Readers return kinds as dicts of :class:`~trainmem.specs.layer_kind.LayerKind` fields (the specs
import the registry, so the registry does not import the specs); ``ModelSpec`` validates them.
"""

from __future__ import annotations

from trainmem.errors import UnsupportedError
from trainmem.families.config import ConfigReader
from trainmem.validate import positive

__all__ = ["uniform_window", "from_layer_types", "kinds_or_empty", "qwen_windows", "pattern_types"]

#: transformers' ``layer_types`` names -> LayerKind.attention
_ATTENTION = {"full_attention": "full", "sliding_attention": "sliding", "chunked_attention": "chunked",
              "linear_attention": "linear"}


def kinds_or_empty(kinds: list[dict]) -> tuple[dict, ...]:
    """Kinds that are all the default (full attention, RoPE, the spec's MLP) need not be written."""
    plain = all(k.get("attention", "full") == "full" and k.get("rope", True) for k in kinds)
    return () if plain and len({k.get("mlp") for k in kinds}) <= 1 else tuple(kinds)


def uniform_window(c: ConfigReader, key: str = "sliding_window") -> tuple[dict, ...]:
    """Every block slides over ``config[key]`` keys (Mistral, Mixtral, Phi-3: one mask for all
    blocks, ``create_sliding_window_causal_mask`` when the key is not None); none when it is None."""
    window = c(key)
    if window is None:
        return ()
    positive(key, window)  # LayerKind.window's rule, named by the config key
    return tuple({"attention": "sliding", "window": window} for _ in range(c("num_hidden_layers")))


def from_layer_types(c: ConfigReader, types: list, *, window: int | None, chunk: int | None = None,
                     moe: list[bool] | None = None, rope: list[bool] | None = None) -> tuple[dict, ...]:
    """Kinds from transformers' per-block ``layer_types`` (``full_attention``, ``sliding_attention``,
    ``chunked_attention``, ``linear_attention``), with each block's MLP and RoPE where they differ."""
    L = c("num_hidden_layers")
    if not isinstance(types, (list, tuple)) or len(types) < L:
        raise UnsupportedError(f"{c.model_type} layer_types={types!r}: expected one entry per block ({L})")
    out = []
    for i, t in enumerate(types[:L]):
        att = _ATTENTION.get(t)
        if att is None:
            raise UnsupportedError(f"{c.model_type} layer_types[{i}]={t!r} is not modelled "
                                   f"(supported: {', '.join(_ATTENTION)})")
        kind: dict = {"attention": att}
        if att == "sliding":
            kind["window"] = window
        elif att == "chunked":
            kind["window"] = chunk
        if moe is not None:
            kind["mlp"] = "moe" if moe[i] else "dense"
        if rope is not None:
            kind["rope"] = rope[i]
        out.append(kind)
    return tuple(out)


def pattern_types(c: ConfigReader, every: int) -> list:
    """``layer_types``, else the config class's default: a full-attention block every ``every``-th,
    sliding ones between (Gemma2Config and GptOssConfig: every 2nd; Gemma3TextConfig: its
    ``sliding_window_pattern``, default 6)."""
    types = c("layer_types")
    if types is None:
        types = ["sliding_attention" if (i + 1) % every else "full_attention" for i in range(c("num_hidden_layers"))]
    return types


def qwen_windows(c: ConfigReader) -> tuple[dict, ...]:
    """Qwen2/Qwen3: sliding blocks from ``max_window_layers`` on, only with ``use_sliding_window``
    (``Qwen2Config.__post_init__``: the window is None otherwise, and so is every block's)."""
    window = c("sliding_window") if c("use_sliding_window") else None
    if window is None:
        return ()
    L = c("num_hidden_layers")
    types = c("layer_types") or ["sliding_attention" if i >= c("max_window_layers") else "full_attention"
                                 for i in range(L)]
    return kinds_or_empty(list(from_layer_types(c, types, window=window)))
