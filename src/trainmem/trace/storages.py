"""Live storages held by weak reference: the one core under every tracker in trainmem.

The tracer's recorder (``trace/_recorder.py``), the CPU meter (``trace/live.py``, behind
``trainmem profile`` and the ground-truth peaks) and the per-rank distributed tracker
(``measure_dist/tracking.py``) all keep their live set here, so a storage means the same thing
to each of them:

* a tensor is read through its local storage: a DTensor's ``_local_tensor`` (nested, as FSDP2
  wraps TP), the bytes this rank really holds;
* a storage is keyed by ``untyped_storage()._cdata`` (fake tensors have ``data_ptr() == 0``) and
  held only through a weak reference, so tracking never extends a lifetime; it leaves the live
  set when its weak reference dies;
* a storage counts at its **current** size at every moment. An op output on a known storage
  re-reads its size (``aten.resize_`` and ``out=`` ops); storages added with ``resizable=True``
  are re-read by :meth:`StorageTracker.refresh`, because ``UntypedStorage.resize_`` (how FSDP2
  allocates and frees its unsharded parameters, ``torch/distributed/fsdp/_fully_shard/
  _fsdp_param.py`` ``alloc_storage`` / ``free_storage``) does not pass through the dispatcher.
  The peak is therefore the most bytes alive at once, with shrinking and regrowth followed.

Known limitations:
  - a storage resized with ``UntypedStorage.resize_`` is followed only if it was added as
    ``resizable`` (or until an op outputs it);
  - sizes are sampled where the tracker is told (op boundaries under a dispatch mode):
    allocations made and freed inside one op are not seen.
"""

from __future__ import annotations

import weakref
from typing import Any, Callable, Iterable

__all__ = ["local", "storage_key", "Entry", "StorageTracker", "parameter_storage_keys", "fsdp_unsharded_tensors",
           "is_parameter", "dispatch_mode"]


def local(t):
    """The tensor this rank stores for ``t``: a DTensor's local shard, else ``t`` itself."""
    while getattr(t, "_local_tensor", None) is not None:
        t = t._local_tensor
    return t


def storage_key(t) -> int:
    return local(t).untyped_storage()._cdata


def _round_up(nbytes: int, multiple: int) -> int:
    return -(-nbytes // multiple) * multiple


class Entry:
    """One live storage: its key, current size and whatever the client attached (``data``)."""

    __slots__ = ("key", "nbytes", "data", "_ref")

    def __init__(self, key: int, nbytes: int, data: Any = None) -> None:
        self.key, self.nbytes, self.data = key, nbytes, data
        self._ref: weakref.ref | None = None


class StorageTracker:
    """The live set: ``live_bytes`` now, ``peak_bytes`` since creation, ``take_peak()`` per interval.

    ``granularity`` rounds every storage up to a multiple (512 models the CUDA caching
    allocator's blocks; 1 counts bytes). ``on_free(entry)`` runs when a storage dies (its entry
    already removed); ``on_resize(entry, old_nbytes)`` when a size change is seen. ``close()``
    drops every weak reference, after which nothing is reported.
    """

    def __init__(self, *, granularity: int = 1, on_free: Callable[[Entry], None] | None = None,
                 on_resize: Callable[[Entry, int], None] | None = None) -> None:
        self.granularity = granularity
        self.entries: dict[int, Entry] = {}
        self._resizable: dict[int, Entry] = {}
        self._on_free = on_free
        self._on_resize = on_resize
        self.live_bytes = 0
        self.peak_bytes = 0
        self._interval_peak = 0

    def size(self, nbytes: int) -> int:
        return nbytes if self.granularity == 1 else _round_up(nbytes, self.granularity)

    def get(self, t) -> Entry | None:
        return self.entries.get(storage_key(t))

    def add(self, t, data: Any = None, *, resizable: bool = False) -> tuple[Entry, bool]:
        """Track ``t``'s (local) storage; returns its entry and whether it is new. A known
        storage has its size re-read (``data`` is then ignored)."""
        st = local(t).untyped_storage()
        key = st._cdata
        entry = self.entries.get(key)
        if entry is not None:
            self._reread(entry, st.nbytes())
            new = False
        else:
            entry = Entry(key, st.nbytes(), data)
            entry._ref = weakref.ref(st, self._finalizer(entry))
            self.entries[key] = entry
            self._grow(self.size(entry.nbytes))
            new = True
        if resizable:
            self._resizable[key] = entry
        return entry, new

    def refresh(self) -> None:
        """Re-read the size of every resizable storage: shrinks first, so a reshard and the next
        unshard seen at the same moment never count both."""
        changed = []
        for entry in list(self._resizable.values()):
            st = entry._ref() if entry._ref is not None else None
            if st is not None and st.nbytes() != entry.nbytes:
                changed.append((st.nbytes() - entry.nbytes, entry, st.nbytes()))
        for _, entry, nbytes in sorted(changed, key=lambda c: c[0]):
            self._reread(entry, nbytes)

    def _reread(self, entry: Entry, nbytes: int) -> None:
        if nbytes == entry.nbytes:
            return
        old = entry.nbytes
        entry.nbytes = nbytes
        delta = self.size(nbytes) - self.size(old)
        if delta > 0:
            self._grow(delta)
        else:
            self.live_bytes += delta
        if self._on_resize is not None:
            self._on_resize(entry, old)

    def _grow(self, nbytes: int) -> None:
        self.live_bytes += nbytes
        if self.live_bytes > self._interval_peak:
            self._interval_peak = self.live_bytes
            if self.live_bytes > self.peak_bytes:
                self.peak_bytes = self.live_bytes

    def _finalizer(self, entry: Entry):
        def free(_ref) -> None:
            if self.entries.get(entry.key) is not entry:
                return
            del self.entries[entry.key]
            self._resizable.pop(entry.key, None)
            self.live_bytes -= self.size(entry.nbytes)
            if self._on_free is not None:
                self._on_free(entry)
        return free

    def reset_peak(self) -> None:
        """Start ``peak_bytes`` and the interval peak from what is alive now."""
        self.peak_bytes = self._interval_peak = self.live_bytes

    def take_peak(self) -> int:
        """The most bytes alive since the previous call; starts a new interval from now."""
        peak, self._interval_peak = self._interval_peak, self.live_bytes
        return peak

    def sum_bytes(self, keys: Iterable[int]) -> int:
        """Current bytes of the live storages among ``keys``."""
        entries = self.entries
        return sum(self.size(entries[k].nbytes) for k in keys if k in entries)

    def close(self) -> None:
        self.entries.clear()
        self._resizable.clear()


def is_parameter(t) -> bool:
    """``t`` is an ``nn.Parameter`` or a view of one."""
    import torch

    base = t._base if t._base is not None else t
    return isinstance(base, torch.nn.Parameter)


def fsdp_unsharded_tensors(model) -> list:
    """FSDP2's unsharded parameters and all-gather outputs (their storages resize to 0 when resharded)."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover - torch without distributed
        return []
    out = []
    for m in model.modules():
        if not isinstance(m, FSDPModule):
            continue
        group = m._get_fsdp_state()._fsdp_param_group
        if group is None:
            continue
        for fp in group.fsdp_params:
            if hasattr(fp, "_unsharded_param"):
                out.append(fp._unsharded_param)
            out.extend(t for t in getattr(fp, "all_gather_outputs", ()) or () if t is not None)
    return out


def parameter_storage_keys(model) -> set[int]:
    """Storages holding ``model``'s parameters on this rank, including FSDP2's unsharded copies."""
    keys = {storage_key(p) for p in model.parameters()}
    for t in fsdp_unsharded_tensors(model):
        keys.add(t.untyped_storage()._cdata)
    return keys


def dispatch_mode(after_op: Callable[[Any, list], None]):
    """A ``TorchDispatchMode`` that runs every op, then calls ``after_op(func, tensors)`` with the
    tensors among its outputs (nested tuples and lists flattened)."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_flatten

    class _AfterOp(TorchDispatchMode):
        @classmethod
        def ignore_compile_internals(cls) -> bool:  # see _recorder.py: compiled graphs run and are seen
            return True

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            after_op(func, [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)])
            return out

    return _AfterOp()
