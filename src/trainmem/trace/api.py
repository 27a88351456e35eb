"""The public context manager: ``with trace(model, optimizer) as t: step()``."""

from __future__ import annotations

from typing import Iterable

from trainmem.errors import UnsupportedError
from trainmem.trace.result import TraceResult, analyze

__all__ = ["trace", "Tracer"]


class Tracer:
    """Records every storage allocation and free while active; ``result`` after exit.

    Parameters, buffers and gradients of ``model`` and the parameters and state of each
    optimizer that exist on entry are the baseline: they count from the start. Optimizer
    parameters that are not model parameters are master weights. Pass the step's input
    tensors as ``inputs`` (or call :meth:`mark_input`) so they count as inputs.

    Known limitations:
      - A storage resized by an op (``aten.resize_``, ``out=``) is recorded as a new block; one
        resized through ``UntypedStorage.resize_`` (FSDP) is not seen until an op outputs it.
      - Only tensors whose storage the dispatch mode sees are counted: op outputs inside the
        context and the baseline; tensors made before entry and not registered are invisible.
      - Module attribution in backward follows torch's ModTracker: a module whose inputs need
        no gradient stays active until backward ends (its post-backward hook cannot fire).
      - Data-dependent ops (``nonzero``, ``item``) cannot run on fake tensors. ``trace_step``
        fixes MoE routing first (:mod:`trainmem.trace.routing`); around your own model, use the
        same ``force_routing`` and ``ConcreteInts``, or real tensors.
    """

    def __init__(self, model=None, optimizer=None, *, inputs: Iterable = (), meta: dict | None = None,
                 progress=None) -> None:
        from trainmem.trace._recorder import _Recorder

        if optimizer is None:
            optimizers = []
        elif isinstance(optimizer, (list, tuple)):
            optimizers = list(optimizer)
        else:
            optimizers = [optimizer]
        self._rec = _Recorder(model, optimizers, progress=progress)
        self._inputs = list(inputs)
        self._buffers: list = []
        self._meta = meta or {}
        self.result: TraceResult | None = None

    def mark_input(self, tensor, name: str = "input") -> None:
        """Count ``tensor``'s storage as an input of the step."""
        self._rec.mark_input(tensor, name)

    def mark_buffer(self, tensor, name: str) -> None:
        """Count ``tensor``'s storage as a buffer of the step, made before it and kept after (a
        pipeline stage's receive buffers, :mod:`trainmem.trace.parallel_pp`); call before entering."""
        self._buffers.append((tensor, name))

    def watch_resizable(self, tensors, names) -> None:
        """Follow these tensors' storages, resized in place between ops (FSDP2's unsharded
        parameters, :mod:`trainmem.trace.parallel_fsdp`), from entry; call before entering."""
        self._rec.watch_resizable(list(tensors), list(names))

    def __enter__(self) -> "Tracer":
        self._rec.__enter__()
        for i, t in enumerate(self._inputs):
            self._rec.mark_input(t, "input" if len(self._inputs) == 1 else f"input.{i}")
        self._inputs = []
        for t, name in self._buffers:
            self._rec.mark_buffer(t, name)
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self._rec.__exit__(exc_type, exc, tb)
        if exc_type is None:
            if not self._rec.rec.events:
                raise UnsupportedError("nothing was allocated inside the trace")
            self.result = analyze(self._rec.rec, self._meta)


def trace(model=None, optimizer=None, *, inputs: Iterable = (), meta: dict | None = None, progress=None) -> Tracer:
    """Trace the memory of whatever runs inside the ``with`` block.

    >>> with trace(model, optimizer, inputs=[ids]) as t:   # doctest: +SKIP
    ...     model(ids, labels=ids).loss.backward(); optimizer.step()
    >>> t.result.peak_bytes                                 # doctest: +SKIP
    """
    return Tracer(model, optimizer, inputs=inputs, meta=meta, progress=progress)
