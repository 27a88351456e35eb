"""DTensor- and FSDP2-aware measurements for one rank: saved activations, model states, step peak.

Everything is read through local shards and the one live-storage core,
:mod:`trainmem.trace.storages`:

* a DTensor (tensor parallel, FSDP2 sharded parameters and their gradients and optimizer
  states) is measured by ``_local_tensor``, the storage this rank really holds;
* FSDP2's unsharded parameters are allocated and freed by resizing one storage in place
  (``untyped_storage().resize_``, which the dispatcher does not see), so the storages watched
  before the step are re-read at every op and count at their current size;
* saved activations are :func:`trainmem.trace.saved.saved_tensors`, the single-process ground
  truth, which reads DTensors locally and leaves FSDP2's unsharded parameters out.

Known limitations:

* storages are sampled at op boundaries (``TorchDispatchMode``); allocations made and freed
  inside one DTensor op, or by the gloo backend outside the dispatcher, are not seen;
* a storage resized in place that was not watched before the step is followed only when an op
  outputs it;
* a view keeps its whole storage alive, so a sequence shard that is a view of a gathered
  tensor counts at the gathered size (that is what the process holds);
* a functional collective's ``AsyncCollectiveTensor`` (and each view of it) is read through its
  ``elem`` (:func:`payload`); other wrapper subclasses than DTensor and it are counted at their
  own storage object.
"""

from __future__ import annotations

import weakref
from dataclasses import asdict, dataclass
from typing import Any, Callable, Iterable

from trainmem.trace.storages import StorageTracker, dispatch_mode, is_parameter
from trainmem.trace.storages import fsdp_unsharded_tensors, local, parameter_storage_keys, storage_key  # noqa: F401

__all__ = ["local", "storage_key", "storage_bytes", "SavedActivations", "saved_activations",
           "LiveTracker", "parameter_storage_keys"]


def payload(t):
    """The tensor whose storage holds ``t``'s bytes on this rank: a DTensor's local shard
    (:func:`local`), and an ``AsyncCollectiveTensor``'s ``elem``. A functional collective's result
    (``torch/distributed/_functional_collectives.py`` ``_maybe_wrap_tensor``, the
    ``_c10d_functional._wrap_tensor_autograd`` op) and every view of it (its ``__torch_dispatch__``
    re-wraps view outputs) is a ``_make_wrapper_subclass`` tensor: a storage object of its own,
    of the wrapped size and with no memory, while the collective's output storage is already
    counted. Read directly, each wrapper would add B·S·H until it dies."""
    from torch.distributed._functional_collectives import AsyncCollectiveTensor

    t = local(t)
    while isinstance(t, AsyncCollectiveTensor):
        t = local(t.elem)
    return t


def storage_bytes(tensors: Iterable, *, exclude: set[int] | None = None) -> int:
    """Bytes of the distinct storages behind ``tensors`` (None entries skipped)."""
    seen: dict[int, int] = {}
    for t in tensors:
        if t is None:
            continue
        st = payload(t).untyped_storage()
        if exclude and st._cdata in exclude:
            continue
        seen[st._cdata] = st.nbytes()
    return sum(seen.values())


@dataclass(frozen=True)
class SavedActivations:
    """:func:`~trainmem.trace.saved.saved_tensors` as the worker's JSON: one dict per storage."""

    items: list[dict]  # shape, dtype, nbytes, grad_fn, dtensor

    @property
    def total_bytes(self) -> int:
        return sum(i["nbytes"] for i in self.items)


def saved_activations(model, fn: Callable[[], Any]) -> tuple[SavedActivations, Any]:
    """:func:`trainmem.trace.saved.saved_tensors` with its result as JSON-ready dicts."""
    from trainmem.trace.saved import saved_tensors

    saved, out = saved_tensors(model, fn)
    return SavedActivations([{**asdict(s), "shape": list(s.shape)} for s in saved]), out


class _Saved:
    """What autograd keeps for one saved tensor; it is released with the graph node."""

    __slots__ = ("t", "__weakref__")

    def __init__(self, t) -> None:
        self.t = t


class LiveTracker:
    """Live local bytes after every op; ``peak_bytes`` is the most seen.

    ``watch(tensors)`` registers storages that exist before the step (parameters, gradients,
    optimizer state, buffers, DDP buckets, FSDP2 unsharded parameters); they are re-read at
    every op, so in-place resizing (FSDP2 reshard) is followed. Storages created by ops inside
    ``with tracker:`` are added as they appear. Every storage is held by weak reference.
    """

    def __init__(self) -> None:
        self.storages = StorageTracker(on_free=self._forget)
        self._watched: set[int] = set()
        self._saved: set[int] = set()  # storages autograd packed for backward (alive)
        self.peak_bytes = 0
        self.peak_saved_bytes = 0  # most bytes autograd held for backward at once
        self._held: dict[int, list[int]] = {}  # storage -> [saved handles alive, bytes]
        self._held_bytes = 0
        self._mode = None
        self.saved_exclude: set[int] = set()  # parameter storages: not activations
        self.peak_op = ""  # the op after which the peak was sampled
        self.peak_parts: dict[str, int] = {}  # at the peak: watched, saved activations, other
        self.peak_other_sizes: list[int] = []  # at the peak: the largest storages neither watched nor saved
        #: live bytes (and parts) after the first call of each op named here: phase marks
        self.marks: dict[str, dict[str, int]] = {}
        self.mark_ops = {"aten._log_softmax_backward_data.default": "loss_backward"}

    def watch(self, tensors: Iterable) -> None:
        for t in tensors:
            if t is not None:
                entry, _ = self.storages.add(t, resizable=True)
                self._watched.add(entry.key)

    def _forget(self, entry) -> None:
        self._watched.discard(entry.key)
        self._saved.discard(entry.key)

    def current_bytes(self) -> int:
        self.storages.refresh()
        return self.storages.live_bytes

    def _parts(self, total: int) -> dict[str, int]:
        watched = self.storages.sum_bytes(self._watched)
        saved = self.storages.sum_bytes(self._saved - self._watched)
        return {"total": total, "watched": watched, "saved_activations": saved, "other": total - watched - saved}

    def _sample(self, op: str = "") -> None:
        self.storages.refresh()
        total = self.storages.live_bytes
        if total > self.peak_bytes:
            self.peak_bytes, self.peak_op = total, op
            self.peak_parts = self._parts(total)
            known = self._watched | self._saved
            self.peak_other_sizes = sorted((e.nbytes for k, e in self.storages.entries.items() if k not in known),
                                           reverse=True)[:16]
        mark = self.mark_ops.get(op)
        if mark and mark not in self.marks:
            self.marks[mark] = self._parts(total)

    def _after_op(self, func, tensors: list) -> None:
        self.storages.refresh()
        for t in tensors:
            self.storages.add(payload(t))
        self._sample(str(func))

    def _pack(self, t):
        lt = payload(t)
        key = lt.untyped_storage()._cdata
        if key in self.saved_exclude or is_parameter(t) or is_parameter(lt):
            return t
        entry, _ = self.storages.add(lt)  # saved inputs made before the step are live memory too
        self._saved.add(key)
        held = self._held.setdefault(key, [0, entry.nbytes])
        if held[0] == 0:
            self._held_bytes += held[1]
            self.peak_saved_bytes = max(self.peak_saved_bytes, self._held_bytes)
        held[0] += 1
        box = _Saved(t)
        weakref.finalize(box, self._release, key)
        return box

    def __enter__(self):
        import torch

        self._sample()
        self._hooks = torch.autograd.graph.saved_tensors_hooks(
            self._pack, lambda b: b.t if isinstance(b, _Saved) else b)
        self._hooks.__enter__()
        self._mode = dispatch_mode(self._after_op)
        self._mode.__enter__()
        return self

    def _release(self, key: int) -> None:
        held = self._held.get(key)
        if held is None:
            return
        held[0] -= 1
        if held[0] == 0:
            self._held_bytes -= held[1]
            del self._held[key]

    def __exit__(self, *exc) -> None:
        self._mode.__exit__(*exc)
        self._hooks.__exit__(*exc)
        self._sample()
        self.storages.close()
