"""The one inventory schema shared by estimate, trace and measure.

Every result in trainmem is a list of :class:`MemoryItem`. Names follow module
paths (``layers.3.attn.q``) so that an estimate and a trace join on the name.
Totals are sums of items; a peak is computed from lifetimes, never summed here.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Iterable, Iterator, Mapping

__all__ = ["Category", "MemoryItem", "Inventory", "Repeat", "DTYPE_BYTES", "LEDGERS", "dtype_bytes"]


class Category(str, enum.Enum):
    PARAMETER = "parameter"
    GRADIENT = "gradient"
    MASTER_WEIGHT = "master_weight"
    OPTIMIZER_STATE = "optimizer_state"
    PAGED_STATE = "paged_optimizer_state"
    """bitsandbytes' paged optimizer states: CUDA unified memory (``cudaMallocManaged``), outside
    PyTorch's caching allocator, so reported as its own figure and never in the allocated peak."""
    ACTIVATION = "activation"
    TRANSIENT = "transient"
    INPUT = "input"
    KV_CACHE = "kv_cache"
    BUFFER = "buffer"
    UNATTRIBUTED = "unattributed"

    def __str__(self) -> str:  # render as the plain value
        return self.value


#: The ledgers reported in ``totals_bytes``, in order.
LEDGERS: tuple[Category, ...] = (
    Category.PARAMETER,
    Category.GRADIENT,
    Category.MASTER_WEIGHT,
    Category.OPTIMIZER_STATE,
    Category.ACTIVATION,
)

DTYPE_BYTES: Mapping[str, float] = {
    "float64": 8, "float32": 4, "bfloat16": 2, "float16": 2,
    "float8": 1, "int64": 8, "int32": 4, "int8": 1, "uint8": 1, "bool": 1,
    "nf4": 0.5, "int4": 0.5,
    # DeepSeek-V2's rotary table is complex64 (``torch.polar``, modeling_deepseek_v2.py)
    "complex64": 8, "complex128": 16,
}


def dtype_bytes(dtype: str) -> float:
    try:
        return DTYPE_BYTES[dtype]
    except KeyError:
        raise KeyError(f"unknown dtype {dtype!r}; known: {', '.join(DTYPE_BYTES)}") from None


@dataclass(frozen=True, kw_only=True)
class MemoryItem:
    """One tensor (or a group of identical tensors) and what it costs.

    ``bytes`` is logical: elements x item size, an ``int``. ``formula`` says
    where the number came from: a symbolic formula for estimates, the creating
    op for traces. ``dims``: for estimates, one symbolic expression per axis of ``shape``
    (``("B", "S", "A·hd")``, see ``trainmem.estimate.symbols``); the formula is rendered from
    them. Empty where there are none (traces, model states, aggregates).
    """

    name: str
    category: Category
    shape: tuple[int, ...]
    dtype: str
    bytes: int
    formula: str = ""
    note: str = ""
    dims: tuple[str, ...] = ()
    key: str = ""
    """The join key where it differs from ``name``: ``<module path>:<k>`` for activations
    (``trainmem.join``); empty means the name is the key."""

    @classmethod
    def make(cls, name: str, category: Category, shape: tuple[int, ...], dtype: str, nbytes: int,
             formula: str = "", dims: tuple[str, ...] = (), key: str = "") -> "MemoryItem":
        """Fast constructor for trusted callers (estimators build thousands of items)."""
        item = object.__new__(cls)
        item.__dict__.update(name=name, category=category, shape=shape, dtype=dtype, bytes=nbytes,
                             formula=formula, note="", dims=dims, key=key)
        return item

    def to_dict(self) -> dict:
        return {
            "name": self.name,
            "key": self.key or self.name,
            "category": self.category.value,
            "shape": list(self.shape),
            "dtype": self.dtype,
            "bytes": self.bytes,
            "formula": self.formula,
            **({"dims": list(self.dims)} if self.dims else {}),
            **({"note": self.note} if self.note else {}),
        }


@dataclass(frozen=True)
class Repeat:
    """Identical blocks stored once: ``items`` of block ``src`` stand for blocks ``dsts``.

    A name starting ``{prefix}{src}.`` becomes ``{prefix}{d}.``; one starting ``{prefix}{src-1}.``
    (a tensor the previous block made and this one keeps) becomes ``{prefix}{d-1}.``.
    """

    items: tuple[MemoryItem, ...]
    prefix: str
    src: int
    dsts: tuple[int, ...]
    shift_previous: bool = True

    def expand(self) -> Iterator[MemoryItem]:
        own = f"{self.prefix}{self.src}."
        prev = f"{self.prefix}{self.src - 1}."
        for d in self.dsts:
            new_own, new_prev = f"{self.prefix}{d}.", f"{self.prefix}{d - 1}."

            def rename(n: str) -> str:
                if n.startswith(own):
                    return new_own + n[len(own):]
                if self.shift_previous and n.startswith(prev):
                    return new_prev + n[len(prev):]
                return n

            def rename_key(k: str) -> str:  # ``<module>:<k>``: the module renamed as a name prefix
                mod, colon, rank = k.rpartition(":")
                return rename(mod + ".")[:-1] + colon + rank if colon else rename(k)
            for it in self.items:
                yield MemoryItem.make(rename(it.name), it.category, it.shape, it.dtype, it.bytes, it.formula, it.dims,
                                      rename_key(it.key) if it.key else "")

    def __len__(self) -> int:
        return len(self.items) * len(self.dsts)


class Inventory:
    """An ordered, immutable collection of memory items.

    Blocks that repeat are kept as :class:`Repeat` templates and expanded only when the items are
    iterated, so totals and peaks of a 126-block model cost one block's work.
    """

    __slots__ = ("base", "repeats", "_items")

    def __init__(self, items: Iterable[MemoryItem] = (), repeats: Iterable[Repeat] = ()) -> None:
        self.base: tuple[MemoryItem, ...] = tuple(items)
        self.repeats: tuple[Repeat, ...] = tuple(repeats)
        self._items: tuple[MemoryItem, ...] | None = None if self.repeats else self.base

    @property
    def items(self) -> tuple[MemoryItem, ...]:
        if self._items is None:
            out = list(self.base)
            for r in self.repeats:
                out.extend(r.expand())
            self._items = tuple(out)
        return self._items

    def __iter__(self) -> Iterator[MemoryItem]:
        return iter(self.items)

    def __len__(self) -> int:
        return len(self.base) + sum(len(r) for r in self.repeats)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Inventory) and self.items == other.items

    def __repr__(self) -> str:
        return f"Inventory({len(self)} items)"

    def __add__(self, other: "Inventory") -> "Inventory":
        return Inventory(self.base + other.base, self.repeats + other.repeats)

    @classmethod
    def of(cls, items: Iterable[MemoryItem]) -> "Inventory":
        return cls(tuple(items))

    def total(self, category: Category | None = None) -> int:
        return sum(v for k, v in self.totals().items() if category is None or k == category.value)

    def totals(self) -> dict[str, int]:
        """Bytes per ledger, every ledger present (zero when empty)."""
        out = {c.value: 0 for c in LEDGERS}
        for item in self.base:
            out[item.category.value] = out.get(item.category.value, 0) + item.bytes
        for r in self.repeats:
            n = len(r.dsts)
            for item in r.items:
                out[item.category.value] = out.get(item.category.value, 0) + item.bytes * n
        return out

    def select(self, category: Category | None = None, prefix: str = "") -> "Inventory":
        return Inventory(tuple(
            i for i in self.items
            if (category is None or i.category is category) and i.name.startswith(prefix)
        ))

    def by_name(self) -> dict[str, int]:
        """Bytes per name; items sharing a name are added."""
        out: dict[str, int] = {}
        for item in self.items:
            out[item.name] = out.get(item.name, 0) + item.bytes
        return out

    def group(self, depth: int) -> dict[str, int]:
        """Bytes per name prefix of ``depth`` dotted parts (``layers.3`` for depth 2)."""
        out: dict[str, int] = {}
        for item in self.items:
            key = ".".join(item.name.split(".")[:depth])
            out[key] = out.get(key, 0) + item.bytes
        return out

    def join(self, other: "Inventory") -> list[tuple[str, int | None, int | None]]:
        """Full outer join by name: ``(name, self_bytes, other_bytes)``; None where absent."""
        a, b = self.by_name(), other.by_name()
        names = list(a) + [n for n in b if n not in a]
        return [(n, a.get(n), b.get(n)) for n in names]
