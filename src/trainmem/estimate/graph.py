"""A tiny symbolic autograd: just enough to know which tensors backward keeps.

Block rules (``rules_*.py``) describe a module's forward as ops on :class:`Sym`
tensors. Each op records what the matching PyTorch kernel saves for backward
(``Graph.save``), de-duplicated by tensor identity exactly as autograd
de-duplicates by storage. Shapes are concrete ints; each tensor also carries its symbolic
dims, one expression per axis (``("B", "S", "A·hd")``), from which the formula shown beside every
number (``B·S·A·hd·2``) is rendered when the tensor becomes an item.
"""

from __future__ import annotations

import math
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Iterator

from trainmem.estimate.symbols import formula, substitute
from trainmem.inventory import Category, Inventory, MemoryItem, Repeat, dtype_bytes

__all__ = ["Sym", "Graph"]


@dataclass(eq=False)
class Sym:
    """A symbolic tensor: one storage. Views share the Sym they view."""

    name: str
    shape: tuple[int, ...]
    dims: tuple[str, ...]  # one symbolic expression per axis, e.g. ("B", "S", "A·hd")
    dtype: str
    rg: bool = True  # requires grad: whether autograd must carry a gradient to it

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return int(self.numel * dtype_bytes(self.dtype))


@dataclass
class Graph:
    """Collects the tensors a forward pass saves for backward."""

    scope: list[str] = field(default_factory=list)
    saved: dict[int, Sym] = field(default_factory=dict)
    _checkpoint: list[dict[int, Sym]] = field(default_factory=list)
    saver: dict[int, str] = field(default_factory=dict)  # module scope that first kept each tensor
    repeats: list[Repeat] = field(default_factory=list)
    subs: dict[str, str] = field(default_factory=dict)
    """Rank-local symbols as global ones (``A`` -> ``A/tp``), applied when items are rendered."""
    _rendered: dict[tuple, tuple[tuple[str, ...], str]] = field(default_factory=dict)

    # naming ------------------------------------------------------------------
    @contextmanager
    def module(self, name: str) -> Iterator[None]:
        self.scope.append(name)
        try:
            yield
        finally:
            self.scope.pop()

    def path(self, label: str) -> str:
        return ".".join([*self.scope, label]) if self.scope else label

    def new(self, label: str, shape: tuple[int, ...], dims: tuple[str, ...], dtype: str, rg: bool = True) -> Sym:
        assert len(dims) == len(shape), (label, shape, dims)
        return Sym(self.path(label), tuple(int(s) for s in shape), tuple(dims), dtype, rg)

    # saving --------------------------------------------------------------------
    def save(self, *tensors: Sym | None, when: bool = True) -> None:
        """Autograd keeps these for backward (no-op for tensors already kept).

        ``when`` is the kernel's condition for keeping them: PyTorch saves an operand only if
        the gradient that needs it is required (derivatives.yaml), e.g. a frozen linear layer
        keeps its weight for the input gradient but not its input.
        """
        if not when:
            return
        target = self._checkpoint[-1] if self._checkpoint else self.saved
        scope = ".".join(self.scope)
        for t in tensors:
            if t is not None:
                target.setdefault(id(t), t)
                self.saver.setdefault(id(t), scope)

    @contextmanager
    def checkpoint(self, *inputs: Sym) -> Iterator[None]:
        """A region under non-reentrant activation checkpointing.

        Inside, nothing is kept; the region's inputs are kept instead (the
        recompute closure holds them) -- torch.utils.checkpoint semantics.
        """
        self._checkpoint.append({})
        try:
            yield
        finally:
            self._checkpoint.pop()
            self.save(*inputs)

    # identical blocks ------------------------------------------------------------
    def mark(self) -> int:
        return len(self.saved)

    def since(self, mark: int) -> list[Sym]:
        return list(self.saved.values())[mark:]

    def repeat(self, template: list[Sym], prefix: str, src: int, dsts: range) -> None:
        """Blocks ``dsts`` keep what block ``src`` kept (``template``), renamed."""
        self.repeats.append(Repeat(tuple(self._item(t) for t in template), prefix, src, tuple(dsts)))

    def inventory(self) -> Inventory:
        return Inventory(self.items(), self.repeats)

    def render(self, t: Sym) -> tuple[tuple[str, ...], str]:
        """``t``'s dims in global symbols and the formula rendered from them."""
        key = (t.dims, t.dtype)
        out = self._rendered.get(key)
        if out is None:
            dims = tuple(substitute(d, self.subs) for d in t.dims)
            out = self._rendered[key] = (dims, formula(dims, dtype_bytes(t.dtype)))
        return out

    def _item(self, t: Sym) -> MemoryItem:
        dims, text = self.render(t)
        return MemoryItem.make(t.name, Category.ACTIVATION, t.shape, t.dtype, t.nbytes, text, dims)

    def savers(self) -> list[str]:
        """The module scope that kept each item of :meth:`items`, in the same order."""
        return [self.saver.get(k, "") for k in self.saved]

    def items(self) -> list[MemoryItem]:
        return [self._item(t) for t in self.saved.values()]
