"""Live storages under a dispatch mode: what PyTorch's CPU tensors cannot tell by themselves.

:class:`LiveStorages` counts the bytes of every storage an op creates while it is active, held
through weak references only (holding them would change the peak), on top of a baseline of
storages alive before. It is the ground truth behind ``trace.saved`` (retained bytes, the step
peak) and behind ``trainmem profile`` on the CPU.
"""

from __future__ import annotations

import weakref
from typing import Any, Iterable

__all__ = ["LiveStorages"]


class LiveStorages:
    """Use as a context manager. ``now``: live bytes; ``peak``: the most since entry;
    ``take_peak()``: the most since the previous call (and starts a new interval)."""

    def __init__(self, baseline: Iterable[Any] = (), *, skip_keys: Iterable[int] = ()) -> None:
        import torch

        self.base: dict[int, int] = {}
        for t in baseline:
            if isinstance(t, torch.Tensor):
                st = t.untyped_storage()
                self.base[st._cdata] = st.nbytes()
        self.skip = set(skip_keys) | set(self.base)
        self.live: dict[int, int] = {}
        self.now = sum(self.base.values())
        self.peak = self._interval = self.now

    def _free(self, key: int) -> None:
        self.now -= self.live.pop(key, 0)

    def track(self, t) -> None:
        st = t.untyped_storage()
        key = st._cdata
        if key in self.skip:
            return
        size = st.nbytes()
        if key in self.live:  # a storage regrown in place counts at its largest
            if size <= self.live[key]:
                return
            self.now += size - self.live[key]
            self.live[key] = size
        else:
            self.live[key] = size
            self.now += size
            weakref.finalize(st, self._free, key)
        if self.now > self._interval:
            self._interval = self.now
            self.peak = max(self.peak, self.now)

    def current(self) -> int:
        return self.now

    def take_peak(self) -> int:
        peak, self._interval = self._interval, self.now
        return peak

    def __enter__(self) -> "LiveStorages":
        import torch
        from torch.utils._python_dispatch import TorchDispatchMode
        from torch.utils._pytree import tree_flatten

        tracker = self

        class _Track(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                for t in tree_flatten(out)[0]:
                    if isinstance(t, torch.Tensor):
                        tracker.track(t)
                return out

        self._mode = _Track()
        self._mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._mode.__exit__(*exc)
