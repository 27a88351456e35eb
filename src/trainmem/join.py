"""Stable join keys for activation items, and the per-tensor join of an estimate with a trace.

An activation's key is ``<module path>:<bytes>B:<k>``: the module that made the tensor (the name up
to its last dot, :func:`module_of`), its size in bytes, and ``k``, its rank (from 0) in creation
order among that module's activations of that size. Both engines can compute it: the estimator's
:class:`~trainmem.estimate.graph.Graph` numbers every tensor it creates (``Sym.seq``), the trace
numbers every storage in allocation order (``Block.id``). The key names neither the estimator's
role label (``q_rope``) nor the aten op (``cat:2``), and the size makes it independent of the
order in which a module makes tensors of different sizes (eager attention's ``repeat_kv`` of v
before or after the softmax; Mixtral's routing indices and expert outputs): only tensors of one
size in one module must come in the same order on both sides. A tensor whose size differs between
the sides shows as two unpaired keys, one per side. Model states keep their names as keys
(``model.layers.0.mlp.up_proj.weight.exp_avg``). A measured step's activations carry the same keys
(``trainmem.measure.tensors``), so :func:`join_sides` pairs estimate, trace and measurement.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Sequence

from trainmem.inventory import Category, MemoryItem

__all__ = ["ROOT", "INPUTS", "module_of", "activation_keys", "item_key", "JoinRow", "join_items", "KeyRow",
           "join_sides"]

ROOT, INPUTS = "(root)", "(inputs)"

#: Modules the tracer sees that are not part of the model tree: the loss is the root's.
_ROOT_ALIASES = ("CrossEntropyLoss",)


def module_of(name: str, *, estimate: bool) -> str:
    """The module an item name belongs to: the name up to its last dot; the estimator's ``loss.*``
    and the trace's ``CrossEntropyLoss.*`` are the root's, the estimator's ``input_ids`` an input."""
    if estimate and name.startswith("loss."):
        return ROOT
    if not estimate and name.split(".", 1)[0] in _ROOT_ALIASES:
        return ROOT
    if estimate and name == "input_ids":
        return INPUTS
    head, dot, _ = name.rpartition(".")
    return head if dot and head else ROOT


def activation_keys(names: Sequence[str], order: Sequence[float], nbytes: Sequence[int], *,
                    estimate: bool) -> list[str]:
    """``<module>:<bytes>B:<k>`` for each name: ``k`` ranks it by ``order`` (creation) among its
    module's tensors of ``nbytes``."""
    groups: dict[tuple[str, int], list[int]] = {}
    for i, n in enumerate(names):
        groups.setdefault((module_of(n, estimate=estimate), int(nbytes[i])), []).append(i)
    keys = [""] * len(names)
    for (mod, size), idx in groups.items():
        for k, i in enumerate(sorted(idx, key=lambda j: (order[j], j))):
            keys[i] = f"{mod}:{size}B:{k}"
    return keys


def item_key(item: MemoryItem) -> str:
    return item.key or item.name


@dataclass(frozen=True)
class JoinRow:
    """One key and the item each side holds under it (None where a side has none)."""

    key: str
    estimate: MemoryItem | None
    trace: MemoryItem | None

    @property
    def equal(self) -> bool:
        e, t = self.estimate, self.trace
        return e is not None and t is not None and (e.dtype, e.bytes) == (t.dtype, t.bytes)

    def to_dict(self) -> dict:
        return {"key": self.key, "estimate": _side(self.estimate), "trace": _side(self.trace), "equal": self.equal}


def _side(i: MemoryItem | None) -> dict | None:
    return None if i is None else {"name": i.name, "dtype": i.dtype, "bytes": i.bytes}


def join_items(estimate: Iterable[MemoryItem], trace: Iterable[MemoryItem],
               categories: tuple[Category, ...] = (Category.ACTIVATION,)) -> list[JoinRow]:
    """Pair the items of ``categories`` by key (estimate order, then the trace's unpaired ones).
    Zero-byte estimate items (notes such as "not saved") are left out."""
    est = {item_key(i): i for i in estimate if i.category in categories and i.bytes}
    tr = {item_key(i): i for i in trace if i.category in categories}
    rows = [JoinRow(k, i, tr.get(k)) for k, i in est.items()]
    return rows + [JoinRow(k, None, i) for k, i in tr.items() if k not in est]


@dataclass(frozen=True)
class KeyRow:
    """One key and the item each named side holds under it (None where a side has none)."""

    key: str
    items: dict[str, MemoryItem | None]

    @property
    def equal(self) -> bool:
        """Every side holds the key, with one dtype and one size."""
        found = list(self.items.values())
        return all(i is not None for i in found) and len({(i.dtype, i.bytes) for i in found}) == 1

    def to_dict(self) -> dict:
        return {"key": self.key, **{name: _side(i) for name, i in self.items.items()}, "equal": self.equal}


def join_sides(sides: dict[str, Iterable[MemoryItem] | None],
               categories: tuple[Category, ...] = (Category.ACTIVATION,)) -> list[KeyRow]:
    """Pair the items of ``categories`` of any number of named sides by key: the first side's keys
    in its order, then each later side's unpaired ones. A side given as None is left out; zero-byte
    items (notes such as "not saved") are left out."""
    got = {name: {item_key(i): i for i in items if i.category in categories and i.bytes}
           for name, items in sides.items() if items is not None}
    keys: dict[str, None] = {}
    for by_key in got.values():
        keys.update(dict.fromkeys(by_key))
    return [KeyRow(k, {name: by_key.get(k) for name, by_key in got.items()}) for k in keys]
