"""Ground truth for activations: what autograd really keeps for backward.

Two measurements, used by the tests that hold the estimator to account:

* :func:`saved_tensors` -- ``saved_tensors_hooks`` during a forward: the distinct storages
  packed for backward, parameters excluded, de-duplicated by storage identity, with shape,
  dtype and the ``grad_fn`` of the tensor that was saved.
* :func:`retained_bytes` -- live-storage tracking: bytes created during a forward that are
  still alive after it (what autograd and checkpoint regions retain). Hooks cannot see inside
  ``torch.utils.checkpoint`` regions; this can.

Known limitations: the hooks see tensors at pack time, so a storage resized later is counted
at its pack size; ``retained_bytes`` counts only storages created by ops inside the call.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any, Callable

__all__ = ["SavedTensor", "saved_tensors", "retained_bytes"]


@dataclass(frozen=True)
class SavedTensor:
    shape: tuple[int, ...]
    dtype: str
    nbytes: int
    grad_fn: str | None


def _storage_key(t) -> int:
    return t.untyped_storage()._cdata


def saved_tensors(model, fn: Callable[[], Any]) -> tuple[list[SavedTensor], Any]:
    """Run ``fn()`` (a forward + loss) and list the distinct storages autograd saved."""
    import torch

    params = {_storage_key(p) for p in model.parameters()}
    seen: dict[int, SavedTensor] = {}

    def pack(t):
        if getattr(t, "_local_tensor", None) is not None:  # DTensor: read the local shard
            t = t._local_tensor
        key = _storage_key(t)
        if key not in params and key not in seen:
            seen[key] = SavedTensor(
                tuple(t.shape), str(t.dtype).removeprefix("torch."),
                t.untyped_storage().nbytes(), t.grad_fn.name() if t.grad_fn is not None else None,
            )
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return list(seen.values()), out


def retained_bytes(model, fn: Callable[[], Any]) -> tuple[int, Any]:
    """Bytes of storages created inside ``fn()`` that are still alive when it returns.

    Parameters and buffers of ``model`` (and views of them) are never counted. Storages are
    held only through weak references, so tracking does not extend lifetimes.
    """
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_flatten
    import torch

    live: dict[int, int] = {}
    existing = {_storage_key(t) for t in (*model.parameters(), *model.buffers())}

    def track(t) -> None:
        if not isinstance(t, torch.Tensor):
            return
        st = t.untyped_storage()
        key = st._cdata
        if key in existing:
            return
        if key in live:
            live[key] = max(live[key], st.nbytes())
            return
        live[key] = st.nbytes()
        weakref.finalize(st, live.pop, key, None)

    class _Track(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in tree_flatten(out)[0]:
                track(t)
            return out

    with _Track():
        out = fn()
    return sum(live.values()), out


def step_peak_bytes(model, optimizer, step: Callable[[], Any]) -> int:
    """Peak live bytes during ``step()`` (forward, backward, ``optimizer.step()``, zero_grad).

    Everything alive before the step -- parameters, buffers, gradients and optimizer state --
    is the baseline; storages created by ops during the step are tracked through weak
    references (CPU tensors report no allocator statistics, so this is the live-set peak).
    """
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_flatten

    base: dict[int, int] = {}

    def add_base(t) -> None:
        if isinstance(t, torch.Tensor):
            st = t.untyped_storage()
            base[st._cdata] = st.nbytes()

    for p in model.parameters():
        add_base(p)
        add_base(p.grad)
    for b in model.buffers():
        add_base(b)
    for state in optimizer.state.values():
        for v in state.values():
            add_base(v)
    live: dict[int, int] = {}
    cur = [sum(base.values())]
    peak = [cur[0]]

    def free(key: int) -> None:
        cur[0] -= live.pop(key, 0)

    def track(t) -> None:
        if not isinstance(t, torch.Tensor):
            return
        st = t.untyped_storage()
        key = st._cdata
        if key in base or key in live:
            return
        live[key] = st.nbytes()
        cur[0] += live[key]
        peak[0] = max(peak[0], cur[0])
        weakref.finalize(st, free, key)

    class _Track(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in tree_flatten(out)[0]:
                track(t)
            return out

    with _Track():
        step()
    return peak[0]
