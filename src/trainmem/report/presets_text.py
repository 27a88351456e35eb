"""``trainmem presets`` as text: one row per preset, its engine and exact parameter counts."""

from __future__ import annotations

from typing import Sequence

__all__ = ["render_presets"]

_ENGINES = {
    "estimate": "estimate: the hand-written hf rules (every command; --profile traced and trace too)",
    "traced": ("traced: no hf rules for its model type or layer kinds yet: "
               "`trainmem estimate --profile traced`, `trainmem trace`"),
}


def _count(n: int | None) -> str:
    return "-" if n is None else f"{n / 1e9:.2f}B {n:,}"


def render_presets(infos: Sequence, *, sources: bool = False) -> str:
    """``infos``: :class:`~trainmem.specs.presets.PresetInfo` rows; ``sources``: each one's ``_source`` too."""
    header = ("preset", "model_type", "engine", "parameters", "active per token")
    rows = [(i.name, i.model_type, i.engine, _count(i.num_parameters),
             _count(i.num_active_parameters) if i.num_active_parameters is not None else "") for i in infos]
    widths = [max(len(r[c]) for r in (header, *rows)) for c in range(len(header))]
    lines = ["  ".join(v.ljust(w) for v, w in zip(r, widths)).rstrip() for r in (header, *rows)]
    used = sorted({i.engine for i in infos})
    lines += [""] + [f"engine {_ENGINES[e]}" for e in used]
    by = sorted({i.counted_by for i in infos if i.counted_by})
    if by:
        lines.append("counted by " + " and ".join(
            {"estimate": "the estimator's parameter layout", "transformers":
             "transformers' model built on the meta device"}[b] for b in by))
    if any(i.num_parameters is None for i in infos):
        lines.append("'-': not counted by the estimator; `trainmem presets --count` builds transformers' model on "
                     "the meta device to count them (needs torch and transformers)")
    if sources:
        lines += [""] + [f"{i.name}: {i.source or 'not named'}" for i in infos]
    else:
        lines.append("each preset's config.json names where it was read from: `trainmem presets --sources`")
    return "\n".join(lines)
