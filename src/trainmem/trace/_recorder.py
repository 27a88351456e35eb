"""The private dispatch mode that records every storage allocation and free.

Every op output's storage becomes a block of a :class:`~trainmem.trace.recording.Recording`
(trace/block_book.py: storages, frees, resizes), filed under the innermost running module
(trace/attribution.py) and the phase the step is in (forward, backward, optimizer); the model states
alive at entry are its baseline (trace/model_states.py). Autocast's cast-cache frees are recorded in
allocation order, so a recording does not depend on memory addresses (trace/autocast_order.py).
"""

from __future__ import annotations

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass

from trainmem.trace.attribution import ModuleStack, in_backward
from trainmem.trace.autocast_order import AutocastFreesInOrder
from trainmem.trace.block_book import BlockBook
from trainmem.trace.low_bit_optim import allocating_paged
from trainmem.trace.model_states import add_grad_hooks, name_unit_grads, register_opt_state, register_states
from trainmem.trace.offload import allocating_on_host
from trainmem.trace.qlora import quantized_parts
from trainmem.trace.recording import (ORIGIN_BUFFER, ORIGIN_FSDP, ORIGIN_INPUT, ORIGIN_OP, ORIGIN_RECOMPUTE,
                                      Recording, short_op)

__all__: list[str] = []


def _inner_tensors(t) -> list:
    """The plain tensors holding a wrapper subclass's bytes (``__tensor_flatten__``, recursively): the
    wrapper's own storage has its nominal size and no memory (a torchao ``Float8Tensor`` made by an op
    under FSDP2's fp8 all-gather is nominally bf16, its ``_data`` fp8)."""
    out = []
    for name in t.__tensor_flatten__()[0]:
        inner = getattr(t, name)
        out += _inner_tensors(inner) if is_traceable_wrapper_subclass(inner) else [inner]
    return out


def _optimizer_phase() -> str:
    """``optimizer``, or ``step_in_backward`` for a step that runs inside backward (a gradient hook,
    ``--optimizer-in-backward``): the estimate's phase names (trainmem.schemas.PHASES)."""
    return "step_in_backward" if in_backward() else "optimizer"


class _Recorder(TorchDispatchMode):
    """Records allocations of every op output into ``rec``; ``book`` holds its live storages."""

    def __init__(self, model: torch.nn.Module | None, optimizers=(), progress=None) -> None:
        super().__init__()
        self.rec = Recording()
        self._modules = ModuleStack(model, self.rec.module_order, progress)
        self.book = BlockBook(self.rec, self._modules.stack)
        self._model = model
        self._optimizers = list(optimizers)
        self._in_opt = 0
        self._handles: list = []
        self._params: set[int] = set()
        self._resizable: list = []  # (tensor, name) whose storage is resized in place (watch_resizable)
        self._autocast = AutocastFreesInOrder(self.book)

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        """torch.compile runs with the recorder on (it would fall back to eager otherwise) and
        the recorder sees the compiled graphs' ops (``trainmem.trace.compiled``)."""
        return True

    def _current(self) -> str:
        if self._in_opt:
            return "optimizer"
        stack = self._modules.stack
        return stack[-1] if stack else ""

    def _phase_now(self) -> str:
        if self._in_opt:
            return _optimizer_phase()
        if in_backward():
            return "backward"
        return "forward" if self._modules.stack or self.book.phase == "forward" else "other"

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        book = self.book
        if self._resizable:  # FSDP2 resizes storages between ops: seen before the op that fills them
            book.set_phase(self._phase_now())
            book.op = "resize_"  # UntypedStorage.resize_ (_fsdp_param.py alloc_storage), seen at this op
            book.storages.refresh()
        out = func(*args, **(kwargs or {}))
        phase = self._phase_now()
        book.set_phase(phase)
        origin = ORIGIN_RECOMPUTE if self._modules.recompute and phase == "backward" else ORIGIN_OP
        if isinstance(out, torch.Tensor):
            self._see(out, func, origin)
        elif isinstance(out, (tuple, list)):
            for o in out:
                if isinstance(o, torch.Tensor):
                    self._see(o, func, origin)
                elif isinstance(o, (tuple, list)):
                    for p in o:
                        if isinstance(p, torch.Tensor):
                            self._see(p, func, origin)
        return out

    def _see(self, t: torch.Tensor, func, origin: str) -> None:
        book = self.book
        if allocating_on_host():
            return  # a host copy made by activation offload (trace/offload.py): never device bytes
        if book.is_host_step(t):
            return  # ``step_t += 1`` (adam.py _single_tensor_adam) outputs a host step counter
        if allocating_paged() or book.is_paged(t):
            book.register_paged(t, op=short_op(func))  # unified memory: outside the allocator's events
            return
        book.op = short_op(func)  # a storage resized by this op is reallocated by it
        parts = quantized_parts(t) if is_traceable_wrapper_subclass(t) else None
        if parts is None and is_traceable_wrapper_subclass(t) and getattr(t, "_local_tensor", None) is None:
            parts = [(None, inner) for inner in _inner_tensors(t)]  # torchao's Float8Tensor (FSDP2 fp8 all-gather)
        for _, inner in parts or ((None, t),):  # a torchao NF4Tensor: its inner storages (trace/qlora.py)
            book.register(inner, origin, self._current(), book.op)

    # -- what the caller names ----------------------------------------------------------
    def mark_input(self, t: torch.Tensor, name: str = "input") -> None:
        self.book.claim(t, ORIGIN_INPUT, "", name)

    def mark_buffer(self, t: torch.Tensor, name: str) -> None:
        """A buffer of the step made before it and kept after (a pipeline stage's receive buffers)."""
        self.book.claim(t, ORIGIN_BUFFER, "", name)

    def watch_resizable(self, tensors, names) -> None:
        """Storages resized in place between ops (FSDP2's all-gather outputs), followed at every op
        from entry; ``names`` labels each (the unsharded parameter it holds)."""
        self._resizable = list(zip(tensors, names))
        self.book.follow_streams = bool(self._resizable)

    # -- optimizer hooks ----------------------------------------------------------------
    def _opt_pre(self, opt, args, kwargs) -> None:
        if self._resizable and self._model is not None and not self._in_opt:
            name_unit_grads(self.book, self._model)
        self._in_opt += 1
        self.book.set_phase(_optimizer_phase())

    def _opt_post(self, opt, args, kwargs) -> None:
        self._in_opt -= 1
        for i, o in enumerate(self._optimizers):
            if o is opt:
                register_opt_state(self.book, self._model, o, i)

    def __enter__(self):
        book = self.book
        book.open = True
        self._params = register_states(book, self._model, self._optimizers)
        for t, name in self._resizable:
            book.register(t, ORIGIN_FSDP, name.rpartition(".")[0], name=name + ".unsharded")
            book.storages.add(t, resizable=True)
        self.rec.baseline = len(self.rec.blocks)
        self.rec.marks.append((len(self.rec.events), book.phase))
        self._handles += add_grad_hooks(book, self._model, self._optimizers, self._params, self._current)
        self._handles.append(register_optimizer_step_pre_hook(self._opt_pre))
        self._handles.append(register_optimizer_step_post_hook(self._opt_post))
        self._modules.__enter__()
        self._saved_hooks = torch.autograd.graph.saved_tensors_hooks(book.mark_saved, lambda t: t)
        self._saved_hooks.__enter__()
        entered = super().__enter__()
        self._autocast.__enter__()
        return entered

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            self._autocast.__exit__(*exc)
            self._saved_hooks.__exit__(*exc)
            self._modules.__exit__(*exc)
            for h in self._handles:
                h.remove()
            self._handles.clear()
            self.book.open = False
            self._modules.done()
            self.book.storages.close()
