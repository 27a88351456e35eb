"""DTensor- and FSDP2-aware measurements for one rank: saved activations, model states, step peak.

These mirror ``trainmem.trace.saved`` but read every tensor through its local shard:

* a DTensor (tensor parallel, FSDP2 sharded parameters and their gradients and optimizer
  states) is measured by ``_local_tensor``, the storage this rank really holds;
* FSDP2's unsharded parameters are allocated and freed by resizing one storage in place
  (``untyped_storage().resize_``), so the live tracker re-reads every storage's current size
  instead of remembering the size it had when first seen.

Known limitations:

* storages are sampled at op boundaries (``TorchDispatchMode``); allocations made and freed
  inside one DTensor op, or by the gloo backend outside the dispatcher, are not seen;
* a view keeps its whole storage alive, so a sequence shard that is a view of a gathered
  tensor counts at the gathered size (that is what the process holds).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any, Callable, Iterable

__all__ = ["local", "storage_key", "storage_bytes", "SavedActivations", "saved_activations",
           "LiveTracker", "parameter_storage_keys"]


def local(t):
    """The tensor this rank stores for ``t``: a DTensor's local shard, else ``t`` itself."""
    while getattr(t, "_local_tensor", None) is not None:
        t = t._local_tensor
    return t


def storage_key(t) -> int:
    return local(t).untyped_storage()._cdata


def storage_bytes(tensors: Iterable, *, exclude: set[int] | None = None) -> int:
    """Bytes of the distinct storages behind ``tensors`` (None entries skipped)."""
    seen: dict[int, int] = {}
    for t in tensors:
        if t is None:
            continue
        st = local(t).untyped_storage()
        if exclude and st._cdata in exclude:
            continue
        seen[st._cdata] = st.nbytes()
    return sum(seen.values())


def parameter_storage_keys(model) -> set[int]:
    """Storages holding ``model``'s parameters on this rank, including FSDP2's unsharded copies."""
    keys = {storage_key(p) for p in model.parameters()}
    for t in fsdp_unsharded_tensors(model):
        keys.add(t.untyped_storage()._cdata)
    return keys


def fsdp_unsharded_tensors(model) -> list:
    """FSDP2's unsharded parameters and all-gather outputs (their storages resize to 0 when resharded)."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover - older torch
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


@dataclass(frozen=True)
class SavedActivations:
    items: list[dict]  # one per distinct storage: shape, dtype, nbytes, grad_fn

    @property
    def total_bytes(self) -> int:
        return sum(i["nbytes"] for i in self.items)


def _is_parameter(t) -> bool:
    import torch

    base = t._base if t._base is not None else t
    return isinstance(base, torch.nn.Parameter)


def saved_activations(model, fn: Callable[[], Any]) -> tuple[SavedActivations, Any]:
    """Run ``fn()`` (a forward + loss) and list the distinct local storages autograd saved.

    Parameters (local shards, FSDP2 unsharded copies, and views of either) are excluded."""
    import torch

    params = parameter_storage_keys(model)
    seen: dict[int, dict] = {}

    def pack(t):
        lt = local(t)
        key = lt.untyped_storage()._cdata
        if key not in params and key not in seen and not _is_parameter(t) and not _is_parameter(lt):
            seen[key] = {"shape": list(lt.shape), "dtype": str(lt.dtype).removeprefix("torch."),
                         "nbytes": lt.untyped_storage().nbytes(),
                         "grad_fn": t.grad_fn.name() if t.grad_fn is not None else None,
                         "dtensor": lt is not t}
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return SavedActivations(list(seen.values())), out


class _Saved:
    """What autograd keeps for one saved tensor; it is released with the graph node."""

    __slots__ = ("t", "__weakref__")

    def __init__(self, t) -> None:
        self.t = t


class LiveTracker:
    """Live local bytes sampled after every op; ``peak_bytes`` is the largest sum seen.

    ``watch(tensors)`` registers storages that exist before the step (parameters, gradients,
    optimizer state, buffers, DDP buckets, FSDP2 unsharded parameters). Storages created by ops
    inside ``with tracker:`` are added as they appear. Every storage is held by weak reference
    and read at its current size, so in-place resizing (FSDP2 reshard) is followed.
    """

    def __init__(self) -> None:
        self._refs: dict[int, weakref.ref] = {}
        self._inflight_saved: dict[int, weakref.ref] = {}
        self.peak_bytes = 0
        self.peak_saved_bytes = 0  # most bytes autograd held for backward at once
        self._held: dict[int, list[int]] = {}  # storage -> [saved handles alive, bytes]
        self._held_bytes = 0
        self._mode = None
        self.saved_exclude: set[int] = set()  # parameter storages: not activations
        self.peak_op = ""  # the op after which the peak was sampled
        self.peak_parts: dict[str, int] = {}  # at the peak: watched, saved activations, other
        self._watched: dict[int, weakref.ref] = {}
        #: live bytes (and parts) after the first call of each op named here: phase marks
        self.marks: dict[str, dict[str, int]] = {}
        self.mark_ops = {"aten._log_softmax_backward_data.default": "loss_backward"}

    def watch(self, tensors: Iterable) -> None:
        for t in tensors:
            if t is not None:
                self._add(local(t), self._refs)
                self._add(local(t), self._watched)

    @staticmethod
    def _add(t, table: dict) -> None:
        st = t.untyped_storage()
        key = st._cdata
        if key not in table:
            table[key] = weakref.ref(st, lambda _r, k=key, tb=table: tb.pop(k, None))

    @staticmethod
    def _sum(table: dict) -> int:
        total = 0
        for r in list(table.values()):
            st = r()
            if st is not None:
                total += st.nbytes()
        return total

    def current_bytes(self) -> int:
        return self._sum(self._refs)

    def _parts(self, total: int) -> dict[str, int]:
        watched = self._sum(self._watched)
        saved = sum(r().nbytes() for k, r in list(self._inflight_saved.items())
                    if k in self._refs and k not in self._watched and r() is not None)
        return {"total": total, "watched": watched, "saved_activations": saved, "other": total - watched - saved}

    def _sample(self, op: str = "") -> None:
        total = self._sum(self._refs)
        if total > self.peak_bytes:
            self.peak_bytes, self.peak_op = total, op
            self.peak_parts = self._parts(total)
        mark = self.mark_ops.get(op)
        if mark and mark not in self.marks:
            self.marks[mark] = self._parts(total)

    def __enter__(self):
        import torch
        from torch.utils._python_dispatch import TorchDispatchMode
        from torch.utils._pytree import tree_flatten

        tracker = self

        class _Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                for t in tree_flatten(out)[0]:
                    if isinstance(t, torch.Tensor):
                        tracker._add(local(t), tracker._refs)
                tracker._sample(str(func))
                return out

        def pack(t):
            lt = local(t)
            st = lt.untyped_storage()
            key = st._cdata
            if key in tracker.saved_exclude or _is_parameter(t) or _is_parameter(lt):
                return t
            tracker._add(lt, tracker._inflight_saved)
            tracker._add(lt, tracker._refs)  # saved inputs made before the step are live memory too
            held = tracker._held.setdefault(key, [0, st.nbytes()])
            if held[0] == 0:
                tracker._held_bytes += held[1]
                tracker.peak_saved_bytes = max(tracker.peak_saved_bytes, tracker._held_bytes)
            held[0] += 1
            box = _Saved(t)
            weakref.finalize(box, tracker._release, key)
            return box

        self._sample()
        self._hooks = torch.autograd.graph.saved_tensors_hooks(pack, lambda b: b.t if isinstance(b, _Saved) else b)
        self._hooks.__enter__()
        self._mode = _Mode()
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
