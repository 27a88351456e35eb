"""Live storages under a dispatch mode: what PyTorch's CPU tensors cannot tell by themselves.

:class:`LiveStorages` counts the bytes of every storage an op creates while it is active, on
top of the storages of ``baseline`` (alive before), all held through weak references only
(holding them would change the peak) in one :class:`trainmem.trace.storages.StorageTracker`:
a storage counts at its current size until it dies, baseline storages included. It is the
ground truth behind ``trace.saved`` (retained bytes, the step peak) and behind ``trainmem
profile`` on the CPU.
"""

from __future__ import annotations

from typing import Any, Iterable

from trainmem.trace.storages import StorageTracker, storage_key

__all__ = ["LiveStorages"]


class LiveStorages:
    """Use as a context manager. ``now``: live bytes; ``peak``: the most since creation;
    ``take_peak()``: the most since the previous call (and starts a new interval).

    Storages in ``skip_keys`` (keys as :func:`~trainmem.trace.storages.storage_key`) are never
    counted, even when an op outputs them."""

    def __init__(self, baseline: Iterable[Any] = (), *, skip_keys: Iterable[int] = ()) -> None:
        import torch

        self.storages = StorageTracker()
        for t in baseline:
            if isinstance(t, torch.Tensor):
                self.storages.add(t)
        self.skip = set(skip_keys)
        self.storages.reset_peak()
        self._mode = None

    @property
    def now(self) -> int:
        return self.storages.live_bytes

    @property
    def peak(self) -> int:
        return self.storages.peak_bytes

    def track(self, t) -> None:
        if self.skip and storage_key(t) in self.skip:
            return
        self.storages.add(t)

    def current(self) -> int:
        return self.storages.live_bytes

    def take_peak(self) -> int:
        return self.storages.take_peak()

    def _after_op(self, func, tensors: list) -> None:
        from trainmem.trace.offload import allocating_on_host
        if allocating_on_host():
            return  # a host copy made by activation offload (trace/offload.py): not device memory
        for t in tensors:
            self.track(t)

    def __enter__(self) -> "LiveStorages":
        from trainmem.trace.storages import dispatch_mode

        self._mode = dispatch_mode(self._after_op)
        self._mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._mode.__exit__(*exc)
