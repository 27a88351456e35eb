"""What "allocated bytes" means on each device, behind one small interface.

* CUDA: the caching allocator's own counters (``torch.cuda.memory_allocated`` and
  ``max_memory_allocated``, reset with ``reset_peak_memory_stats``).
* CPU: CPU tensors report no allocator statistics, so the live set is tracked
  (:mod:`trainmem.trace.storages`, as in :func:`trainmem.trace.saved.step_peak_bytes`): every
  storage an op creates and every baseline tensor alive before the step counts at its current
  size until its weak reference dies.

``take_peak()`` returns the highest value since the previous call and starts a new interval;
module hooks use it to attribute the peak between two hook events to the modules running then.
"""

from __future__ import annotations

from trainmem.trace.live import LiveStorages

__all__ = ["CudaMeter", "LiveSetMeter", "ModulePeakHooks"]


class CudaMeter:
    def __init__(self, device) -> None:
        import torch
        self.torch = torch
        self.device = device
        self.peak_bytes = 0

    def __enter__(self) -> "CudaMeter":
        self.torch.cuda.synchronize(self.device)
        self.torch.cuda.reset_peak_memory_stats(self.device)
        return self

    def __exit__(self, *exc) -> None:
        self.take_peak()

    def current(self) -> int:
        return self.torch.cuda.memory_allocated(self.device)

    def take_peak(self) -> int:
        peak = self.torch.cuda.max_memory_allocated(self.device)
        self.peak_bytes = max(self.peak_bytes, peak)
        self.torch.cuda.reset_peak_memory_stats(self.device)
        return peak


class LiveSetMeter(LiveStorages):
    """The CPU meter: live storages on top of ``baseline`` (:class:`trainmem.trace.live.LiveStorages`)."""

    @property
    def peak_bytes(self) -> int:
        return self.peak


def _tensors(obj, out: list) -> list:
    import torch
    if isinstance(obj, torch.Tensor):
        out.append(obj)
    elif isinstance(obj, (tuple, list)):
        for o in obj:
            _tensors(o, out)
    elif isinstance(obj, dict):
        for o in obj.values():
            _tensors(o, out)
    return out


class ModulePeakHooks:
    """Per-module forward and backward peaks from module and tensor hooks.

    Forward: a module is active between its forward pre-hook and forward hook. Backward: it
    becomes active when the gradient of one of its outputs arrives and stops when the
    gradient of one of its inputs is computed (or at the end of backward, for modules whose
    inputs need no gradient, such as the embedding). Forwards re-run by activation
    checkpointing during backward count as backward.
    """

    def __init__(self, model, meter) -> None:
        self.meter = meter
        self.order: list[str] = []
        self.forward: dict[str, int] = {}
        self.backward: dict[str, int] = {}
        self._fwd_stack: list[str] = []
        self._bwd_active: set[str] = set()
        self._handles = []
        for name, mod in model.named_modules():
            if not name:
                continue
            name = name.removeprefix("module.")  # DDP
            self.order.append(name)
            self._handles.append(mod.register_forward_pre_hook(self._pre(name)))
            self._handles.append(mod.register_forward_hook(self._post(name)))

    @staticmethod
    def _in_backward() -> bool:
        import torch
        return torch._C._current_graph_task_id() != -1

    def _sample(self) -> None:
        peak = self.meter.take_peak()
        table = self.backward if self._in_backward() else self.forward
        for n in self._fwd_stack:
            table[n] = max(table.get(n, 0), peak)
        for n in self._bwd_active:
            self.backward[n] = max(self.backward.get(n, 0), peak)

    def _pre(self, name: str):
        def hook(mod, args):
            self._sample()
            self._fwd_stack.append(name)
            if not self._in_backward():
                for t in _tensors(args, []):
                    if t.requires_grad:
                        t.register_hook(self._input_grad(name))
        return hook

    def _post(self, name: str):
        def hook(mod, args, out):
            self._sample()
            if self._fwd_stack and self._fwd_stack[-1] == name:
                self._fwd_stack.pop()
            if not self._in_backward():
                for t in _tensors(out, []):
                    if t.requires_grad:
                        t.register_hook(self._output_grad(name))
        return hook

    def _output_grad(self, name: str):
        def hook(grad):
            self._sample()
            self._bwd_active.add(name)
        return hook

    def _input_grad(self, name: str):
        def hook(grad):
            self._sample()
            self._bwd_active.discard(name)
        return hook

    def end_step(self) -> None:
        """Close the step: modules still active get the last interval's peak."""
        self._sample()
        self._bwd_active.clear()
        self._fwd_stack.clear()

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
