"""The peak of each of a run's first steps, measured where the steps run.

* CUDA: ``torch.cuda.max_memory_allocated`` and ``max_memory_reserved``, reset before each step.
* CPU: live storages (:class:`trainmem.trace.live.LiveStorages`, the meter behind ``trainmem
  profile`` on CPU), active only between :meth:`StepMeter.begin_step` and :meth:`end_step`, on a
  baseline of the parameters, buffers, gradients and optimizer states alive before the first step.

Known limitations:
  - CPU: storages created between steps (logging, the learning-rate schedule) are not counted; a
    step that raises leaves the dispatch mode active until :meth:`close`.
"""

from __future__ import annotations

from trainmem.integrations.check import Measured

__all__ = ["StepMeter"]


class StepMeter:
    def __init__(self, model, optimizer, device) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        self.peaks: list[int] = []
        self.reserved = 0
        self._live = None
        self._active = False
        if not self.cuda:
            from trainmem.measure.instrumented import baseline_tensors
            from trainmem.trace.live import LiveStorages
            self._live = LiveStorages(baseline_tensors(model, getattr(optimizer, "optimizer", optimizer), ()))

    @property
    def active(self) -> bool:
        """Between begin_step and end_step."""
        return self._active

    def begin_step(self) -> None:
        if self.cuda:
            import torch
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            self._live.take_peak()  # a new interval from what is alive now
            self._live.__enter__()
        self._active = True

    def end_step(self) -> int:
        if not self._active:
            raise RuntimeError("end_step without begin_step")
        self._active = False
        if self.cuda:
            import torch
            torch.cuda.synchronize(self.device)
            peak = int(torch.cuda.max_memory_allocated(self.device))
            self.reserved = max(self.reserved, int(torch.cuda.max_memory_reserved(self.device)))
        else:
            self._live.__exit__(None, None, None)
            peak = self._live.take_peak()
        self.peaks.append(peak)
        return peak

    def close(self) -> Measured | None:
        """The steps measured so far (None if none finished); leaves no mode active."""
        if self._active and not self.cuda:
            self._live.__exit__(None, None, None)
        self._active = False
        if not self.peaks:
            return None
        source = ("torch.cuda.max_memory_allocated" if self.cuda
                  else "live storages (trainmem.trace.live.LiveStorages)")
        return Measured(str(self.device), source, tuple(self.peaks), self.reserved if self.cuda else None)
