"""A tiny symbolic autograd: just enough to know which tensors backward keeps.

Block rules (``rules_*.py``) describe a module's forward as ops on :class:`Sym`
tensors. Each op records what the matching PyTorch kernel saves for backward
(``Graph.save``), de-duplicated by tensor identity (:meth:`Graph.key`) exactly as autograd
de-duplicates by storage. Shapes are concrete ints; each tensor also carries its symbolic
dims, one expression per axis (``("B", "S", "A·hd")``), from which the formula shown beside every
number (``B·S·A·hd·2``) is rendered when the tensor becomes an item.
"""

from __future__ import annotations

import itertools
import math
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Iterator

from trainmem.estimate.symbols import formula, substitute
from trainmem.join import activation_keys
from trainmem.inventory import Category, Inventory, MemoryItem, Repeat, dtype_bytes

__all__ = ["Sym", "Graph", "OpPolicy", "SAVED_OPS", "Key"]

Key = tuple[int, int]
"""A tensor's identity in a graph: (the graph's number, the tensor's number in it), :meth:`Graph.key`."""
_GRAPHS = itertools.count()

SAVED_OPS = frozenset({"mm", "addmm", "bmm", "sdpa_flash", "sdpa_efficient", "max", "topk"})
"""The ops torchtitan's op-level policy keeps (torchtitan/distributed/activation_checkpoint.py at
b5bcd76, ``_get_default_save_ops``: torch._functorch.partitioners' ``compute_intensive_ops`` --
mm, addmm, bmm, the CUDA flash and memory-efficient SDPA kernels -- plus aten.linear, max, topk
and collectives; of those aten.max runs here in Float8's tensorwise amax, ``estimate/float8.py``, and
aten.topk in Llama-4's router, ``estimate/rules_llama4.py``).
The CPU SDPA kernel
(``_scaled_dot_product_flash_attention_for_cpu``) is not on it."""


@dataclass(eq=False)
class Sym:
    """A symbolic tensor: one storage. Views share the Sym they view."""

    name: str
    shape: tuple[int, ...]
    dims: tuple[str, ...]  # one symbolic expression per axis, e.g. ("B", "S", "A·hd")
    dtype: str
    requires_grad: bool = True  # whether autograd must carry a gradient to it
    op: str | None = None  # the aten op whose output this is, where a checkpoint policy asks ("mm", "bmm", ...)
    seq: int = -1  # creation order (Graph.new), for the join key; -1 for a view made outside the graph
    input: bool = False  # a model input (token ids), not an op's output: keyed ``(inputs):<bytes>B:<k>``
    uid: Key | None = field(default=None, repr=False)  # set by the graph that first keys it (Graph.key)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return int(self.numel * dtype_bytes(self.dtype))


@dataclass
class OpPolicy:
    """torchtitan's op-level selective checkpointing policy for one block's forward.

    torchtitan/distributed/activation_checkpoint.py (b5bcd76) ``SelectiveAC._wrap_block``,
    ``wrapped_policy``: a fresh ``forward_mm_count`` per checkpoint call; each aten.mm adds one
    before the decision, and an mm whose count is even is recomputed -- the 1st, 3rd, 5th... mm
    of the block are kept, the 2nd, 4th... recomputed. addmm and bmm are not counted and always kept.
    """

    mm_count: int = 0

    def save(self, op: str) -> bool:
        if op == "mm":
            self.mm_count += 1
            return self.mm_count % 2 == 1
        return op in SAVED_OPS


@dataclass
class Graph:
    """Collects the tensors a forward pass saves for backward."""

    scope: list[str] = field(default_factory=list)
    saved: dict[Key, Sym] = field(default_factory=dict)
    _checkpoint: list[dict[Key, Sym]] = field(default_factory=list)
    _policies: list[OpPolicy | None] = field(default_factory=list)  # one per open checkpoint region
    _cached: list[dict[Key, Sym]] = field(default_factory=list)  # the op outputs each region's policy keeps
    saver: dict[Key, str] = field(default_factory=dict)  # module scope that first kept each tensor
    repeats: list[Repeat] = field(default_factory=list)
    keeper: dict[Key, tuple[str, int | None]] = field(default_factory=dict)
    """For each tensor in ``saved``: the scope of the save that kept it and, for a checkpointed
    region's input, its position among the region's inputs (activation offload asks)."""
    subs: dict[str, str] = field(default_factory=dict)
    """Rank-local symbols as global ones (``A`` -> ``A/tp``), applied when items are rendered."""
    _rendered: dict[tuple, tuple[tuple[str, ...], str]] = field(default_factory=dict)
    _seq: dict[str, int] = field(default_factory=dict)  # creation order by name (views made outside share it)
    _number: int = field(default_factory=lambda: next(_GRAPHS))
    _uids: Iterator[int] = field(default_factory=itertools.count)

    def key(self, t: Sym) -> Key:
        """``t``'s identity in this graph, numbered when the graph first sees it. Not ``id()``: a
        checkpointed region's saves are dropped when it closes, and a later tensor that reused a
        freed id would inherit its saver (a pipeline stage chosen at random, run to run)."""
        if t.uid is None:
            t.uid = (self._number, next(self._uids))
        assert t.uid[0] == self._number, f"{t.name} was keyed by another graph"
        return t.uid

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

    def new(self, label: str, shape: tuple[int, ...], dims: tuple[str, ...], dtype: str, requires_grad: bool = True,
            op: str | None = None, input: bool = False) -> Sym:
        """A new storage; ``op`` names the aten op that produced it, for the policy of the
        innermost checkpoint region (:meth:`checkpoint`), which may keep it; ``input``: a model input."""
        assert len(dims) == len(shape), (label, shape, dims)
        t = Sym(self.path(label), tuple(int(s) for s in shape), tuple(dims), dtype, requires_grad, op, len(self._seq),
                input)
        self._seq.setdefault(t.name, t.seq)
        if op is not None and self._policies and self._policies[-1] is not None and self._policies[-1].save(op):
            self._cached[-1].setdefault(self.key(t), t)
            self.saver.setdefault(self.key(t), ".".join(self.scope))
        return t

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
                k = self.key(t)
                if target is self.saved and k not in target:
                    self.keeper[k] = (scope, None)
                target.setdefault(k, t)
                self.saver.setdefault(k, scope)

    @contextmanager
    def checkpoint(self, *inputs: Sym, policy: OpPolicy | None = None) -> Iterator[None]:
        """A region under non-reentrant activation checkpointing.

        Inside, nothing is kept; the region's inputs are kept instead (the
        recompute closure holds them) -- torch.utils.checkpoint semantics.
        With a ``policy`` (selective checkpointing, ``create_selective_checkpoint_contexts``),
        the outputs of the ops it saves are kept too, whether or not backward reads them:
        torch/utils/checkpoint.py ``_CachingTorchDispatchMode`` stores every MUST_SAVE output
        in the forward and ``_CachedTorchDispatchMode`` hands it back during the recompute.
        """
        self._checkpoint.append({})
        self._policies.append(policy)
        self._cached.append({})
        try:
            yield
        finally:
            self._checkpoint.pop()
            self._policies.pop()
            cached = self._cached.pop()
            target = self._checkpoint[-1] if self._checkpoint else self.saved
            for k, t in cached.items():
                if target is self.saved and k not in target:
                    self.keeper[k] = (".".join(self.scope), None)
                target.setdefault(k, t)
            fresh = [t is not None and target is self.saved and self.key(t) not in target for t in inputs]
            self.save(*inputs)
            for i, (t, new) in enumerate(zip(inputs, fresh)):
                # a keyword input (i > 0) an earlier eager block saved too (every-k's rotary cos/sin, block 0 eager
                # under torchtitan's count): the closure holds it all the same (estimate/activation_offload.py)
                if new or (i > 0 and t is not None and target is self.saved):
                    self.keeper[self.key(t)] = (".".join(self.scope), i)

    # identical blocks ------------------------------------------------------------
    def mark(self) -> int:
        return len(self.saved)

    def since(self, mark: int) -> list[Sym]:
        return list(self.saved.values())[mark:]

    def repeat(self, template: list[Sym], prefix: str, src: int, dsts: range) -> None:
        """Blocks ``dsts`` keep what block ``src`` kept (``template``), renamed."""
        keys = self._keys()
        self.repeats.append(Repeat(tuple(self._item(t, keys[self.key(t)]) for t in template), prefix, src, tuple(dsts)))

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

    def _item(self, t: Sym, key: str = "") -> MemoryItem:
        dims, text = self.render(t)
        return MemoryItem.make(t.name, Category.ACTIVATION, t.shape, t.dtype, t.nbytes, text, dims, key)

    def _keys(self) -> dict[Key, str]:
        """The join key (``trainmem.join``) of every kept tensor: its module, its bytes and its rank
        in creation order among the module's kept tensors of that size. A Sym made outside
        :meth:`new` (a view, a repeated block's output) takes the order of the tensor of its name,
        else comes last."""
        syms = list(self.saved.values())
        order = [t.seq if t.seq >= 0 else self._seq.get(t.name, len(self._seq)) for t in syms]
        keys = activation_keys(["input_ids" if t.input else t.name for t in syms], order, [t.nbytes for t in syms],
                               estimate=True)
        return {self.key(t): k for t, k in zip(syms, keys)}

    def savers(self) -> list[str]:
        """The module scope that kept each item of :meth:`items`, in the same order."""
        return [self.saver.get(k, "") for k in self.saved]

    def keepers(self) -> list[tuple[str, int | None]]:
        """:attr:`keeper` for each item of :meth:`items`, in the same order."""
        return [self.keeper.get(k, ("", None)) for k in self.saved]

    def items(self) -> list[MemoryItem]:
        keys = self._keys()
        return [self._item(t, keys[self.key(t)]) for t in self.saved.values()]
