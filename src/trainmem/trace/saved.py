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


class _Live:
    """Storages created by ops while active, held through weak references only: their live
    bytes now and at most. Storages in ``skip`` (parameters, state alive before) never count."""

    def __init__(self, skip: dict[int, int]) -> None:
        self.skip = skip
        self.live: dict[int, int] = {}
        self.now = sum(skip.values())
        self.peak = self.now

    def _free(self, key: int) -> None:
        self.now -= self.live.pop(key, 0)

    def track(self, t) -> None:
        st = t.untyped_storage()
        key = st._cdata
        if key in self.skip:
            return
        size = st.nbytes()
        if key in self.live:  # resized in place (e.g. an FSDP-style storage regrown)
            self.now += max(0, size - self.live[key])
            self.live[key] = max(self.live[key], size)
        else:
            self.live[key] = size
            self.now += size
            weakref.finalize(st, self._free, key)
        self.peak = max(self.peak, self.now)

    def __enter__(self):
        import torch
        from torch.utils._python_dispatch import TorchDispatchMode
        from torch.utils._pytree import tree_flatten

        live = self

        class _Track(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                for t in tree_flatten(out)[0]:
                    if isinstance(t, torch.Tensor):
                        live.track(t)
                return out

        self._mode = _Track()
        self._mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._mode.__exit__(*exc)


def retained_bytes(model, fn: Callable[[], Any]) -> tuple[int, Any]:
    """Bytes of storages created inside ``fn()`` that are still alive when it returns.

    Parameters and buffers of ``model`` (and views of them) are never counted. Storages are
    held only through weak references, so tracking does not extend lifetimes.
    """
    existing = {_storage_key(t): 0 for t in (*model.parameters(), *model.buffers())}
    with _Live(existing) as live:
        out = fn()
    return sum(live.live.values()), out


def step_peak_bytes(model, optimizer, step: Callable[[], Any]) -> int:
    """Peak live bytes during ``step()`` (forward, backward, ``optimizer.step()``, zero_grad).

    Everything alive before the step -- parameters, buffers, gradients and optimizer state --
    is the baseline; storages created by ops during the step are tracked through weak
    references (CPU tensors report no allocator statistics, so this is the live-set peak).
    """
    import torch

    base: dict[int, int] = {}
    tensors = [*model.parameters(), *(p.grad for p in model.parameters()), *model.buffers(),
               *(v for state in optimizer.state.values() for v in state.values())]
    for t in tensors:
        if isinstance(t, torch.Tensor):
            st = t.untyped_storage()
            base[st._cdata] = st.nbytes()
    with _Live(base) as live:
        step()
    return live.peak
