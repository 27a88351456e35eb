"""Pieces of a parameter layout: ``(name, shape)`` lists as ``named_parameters()`` yields them."""

from __future__ import annotations

from typing import TYPE_CHECKING

from trainmem.errors import UnsupportedError

if TYPE_CHECKING:  # pragma: no cover
    from trainmem.specs.model import ModelSpec

__all__ = ["Params", "linear", "conv1d", "norm", "embedding", "up_width", "refuse", "lm_head"]

Params = list[tuple[str, tuple[int, ...]]]


def linear(name: str, out_features: int, in_features: int, bias: bool) -> Params:
    """``nn.Linear``: weight ``[out, in]``, then bias ``[out]``."""
    params = [(f"{name}.weight", (out_features, in_features))]
    if bias:
        params.append((f"{name}.bias", (out_features,)))
    return params


def conv1d(name: str, in_features: int, out_features: int, bias: bool) -> Params:
    """GPT-2's ``Conv1D`` stores the weight transposed: ``[in, out]``."""
    params = [(f"{name}.weight", (in_features, out_features))]
    if bias:
        params.append((f"{name}.bias", (out_features,)))
    return params


def norm(m: "ModelSpec", name: str, size: int | None = None) -> Params:
    size = m.hidden_size if size is None else size
    params = [(f"{name}.weight", (size,))]
    if m.norm == "layernorm" and m.norm_bias:
        params.append((f"{name}.bias", (size,)))
    return params


def embedding(name: str, rows: int, width: int) -> Params:
    return [(f"{name}.weight", (rows, width))]


def up_width(m: "ModelSpec", ffn_size: int) -> int:
    """Output width of the (packed) up-projection: gate and value branches for gated activations."""
    return 2 * ffn_size if m.gated else ffn_size


def refuse(m: "ModelSpec", *features: str) -> None:
    """Refuse spec features a family's HF code has no parameter for."""
    present = {
        "MoE": m.is_moe,
        "qk_norm": m.qk_norm,
        "max_positions": m.max_positions > 0,
        "type_vocab_size": m.type_vocab_size > 0,
    }
    used = [f for f in features if present[f]]
    if used:
        raise UnsupportedError(
            f"family {m.family!r} has no parameter layout for {', '.join(used)} "
            f"(model {m.name!r}); use family 'generic' for Llama-style names"
        )


def lm_head(m: "ModelSpec") -> Params:
    return [] if m.tied_embeddings else embedding("lm_head", m.vocab_size, m.hidden_size)
