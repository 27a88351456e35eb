"""LayerKind: what one Transformer block is, where a model's blocks differ.

A :class:`~trainmem.specs.model.ModelSpec` whose blocks are all alike leaves ``layer_kinds``
empty; one whose blocks differ (DeepSeek-V3's first dense blocks then MoE, Gemma-3's local and
global attention, Llama-4's chunked NoPE-less layers and MoE interleave, gpt-oss's sliding/full
alternation, qwen3_next's linear-attention blocks) gives one kind per block. The widths a kind
uses stay on the spec (``ffn_size`` for a dense MLP, ``expert_ffn_size`` and ``num_experts`` for
an MoE one), so tensor parallelism still divides them in one place.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Mapping

from trainmem.errors import SpecError
from trainmem import validate as v

__all__ = ["LayerKind", "ATTENTION_KINDS", "MLP_KINDS", "as_layer_kind", "fit_kinds"]

#: ``full``: causal attention over the whole sequence; ``sliding``: each query sees the last
#: ``window`` keys (Mistral, Gemma-2/3 local layers, gpt-oss); ``chunked``: keys of the query's own
#: ``window``-token chunk (Llama-4); ``linear``: a linear-attention (gated DeltaNet) mixer (qwen3_next).
ATTENTION_KINDS = ("full", "sliding", "chunked", "linear")
MLP_KINDS = ("dense", "moe")


@dataclass(frozen=True)
class LayerKind:
    """One block's kind: its token mixer and its MLP."""

    attention: str = "full"
    """``full``, ``sliding``, ``chunked`` or ``linear`` (:data:`ATTENTION_KINDS`)."""
    window: int = 0
    """Keys a query may see (``sliding``) or the chunk length (``chunked``); 0 otherwise."""
    rope: bool = True
    """Rotary embeddings on q and k; False for Llama-4's NoPE layers."""
    mlp: str = "dense"
    """``dense`` (the spec's ``ffn_size``) or ``moe`` (its experts)."""

    def __post_init__(self) -> None:
        v.one_of("layer_kinds.attention", self.attention, ATTENTION_KINDS)
        v.one_of("layer_kinds.mlp", self.mlp, MLP_KINDS)
        v.boolean("layer_kinds.rope", self.rope)
        if self.attention in ("sliding", "chunked"):
            v.positive("layer_kinds.window", self.window)
        elif self.window != 0:
            raise SpecError("layer_kinds.window", self.window, f"is only for sliding or chunked attention, "
                                                                f"not {self.attention}")

    @property
    def label(self) -> str:
        """A short name: ``sliding(4096)+moe``, ``full``, ``linear+moe``, ``chunked(8192)/nope``."""
        att = f"{self.attention}({self.window})" if self.window else self.attention
        return att + ("" if self.rope else "/nope") + ("+moe" if self.mlp == "moe" else "")

    def to_dict(self) -> dict:
        return asdict(self)


def as_layer_kind(value: Any) -> LayerKind:
    """A :class:`LayerKind`, or a dict of its fields (a spec read back from JSON)."""
    if isinstance(value, LayerKind):
        return value
    if isinstance(value, Mapping):
        unknown = sorted(set(value) - {"attention", "window", "rope", "mlp"})
        if unknown:
            raise SpecError("layer_kinds", dict(value), f"has unknown keys {', '.join(unknown)}")
        return LayerKind(**value)
    raise SpecError("layer_kinds", value, "each kind must be a LayerKind or a dict of its fields")


def fit_kinds(kinds: tuple[LayerKind, ...], n: int) -> tuple[LayerKind, ...]:
    """``kinds`` for a model of ``n`` blocks: the first ``n`` when there are more (a model cut,
    as transformers' ``layer_types[:n]``), or the pattern grown by repeating its last period (the
    smallest ``p`` with ``kinds[i] == kinds[i - p]`` over the last half, or two periods if longer: DeepSeek's MoE tail,
    Gemma-3's five local blocks and one global) when there are fewer."""
    if len(kinds) >= n or not kinds:
        return kinds[:n]
    have = len(kinds)
    p = next(p for p in range(1, have + 1)
             if all(kinds[i] == kinds[i - p] for i in range(max(p, have - max(2 * p, have // 2)), have)))
    return kinds + tuple(kinds[have - p + (i % p)] for i in range(n - have))
