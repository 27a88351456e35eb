"""What a DTensor step does on a real group that a fake one records otherwise: loss_parallel's handlers run
with the dispatch modes that the DTensor op hides them from (:func:`loss_handlers_seen`), and a functional
collective's wait returns its input (:func:`waits_return_their_input`).

Known limitations: only ``loss_parallel()``'s handlers are wrapped (the ops DTensor runs by sharding
strategy make one local output each, which the recorder reads off the DTensor it returns); a compiled
graph's ``wait_tensor`` nodes call the op itself (trace/compiled.py reads them as the partitioner keeps them).
"""

from __future__ import annotations

import contextlib

__all__ = ["loss_handlers_seen", "waits_return_their_input"]


@contextlib.contextmanager
def loss_handlers_seen():
    """Run ``loss_parallel()``'s DTensor op handlers (torch/distributed/tensor/parallel/loss.py
    ``customized_loss_ops``: ``_log_softmax``, ``nll_loss_forward`` and their backwards) with every
    dispatch mode that was active on entry, so a recorder sees their local ops.

    Why a recorder misses them otherwise: a ``TorchDispatchMode`` sees an op before a tensor subclass does
    and runs it with itself popped off the mode stack (torch/utils/_python_dispatch.py); the op on DTensors
    then reaches ``DTensor.__torch_dispatch__``, whose handler computes on the local shards (``exp``,
    ``sum``, ``all_reduce``, the fused backward's ``zeros`` and ``scatter``...) below that mode. The outer
    op's output is the only storage it records; the handler's temporaries, which the real step allocates
    (torch.profiler's ``profile_memory`` sees them), are lost. A mode that was on the stack on entry and is
    off it when a handler runs is one handling that op: it is pushed back for the handler's duration
    (``_push_mode``/``_pop_mode``, as ``_pop_mode_temporarily`` does the other way), below nothing it did
    not have above it. The handler's local output is then recorded as its op makes it; the outer op's
    output DTensor holds that storage and is not counted twice (trace/block_book.py ``register``)."""
    import torch.distributed.tensor.parallel.loss as loss
    from torch.distributed.tensor import DTensor
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack, _pop_mode, _push_mode

    entered = _get_current_dispatch_mode_stack()
    handlers = DTensor._op_dispatcher._custom_op_handlers
    original = {op: handlers[op] for op in loss.customized_loss_ops if op in handlers}
    meta = loss._propagate_tensor_meta
    pushed: list = []  # the modes pushed back for the running handler

    def seen(handler):
        def run(*args, **kwargs):
            now = _get_current_dispatch_mode_stack()
            popped = [m for m in entered if not any(m is n for n in now)] if len(now) < len(entered) else []
            for m in popped:
                _push_mode(m)
            pushed.append(popped)
            try:
                return handler(*args, **kwargs)
            finally:
                pushed.pop()
                for _ in popped:
                    _pop_mode()
        return run

    def global_meta(*args, **kwargs):
        # the handler's output metadata: the op run on global-shape fake tensors (ShardingPropagator
        # ``_propagate_tensor_meta_non_cached``), no memory on a real rank: off the pushed modes
        modes = pushed[-1] if pushed else []
        for _ in modes:
            _pop_mode()
        try:
            return meta(*args, **kwargs)
        finally:
            for m in modes:
                _push_mode(m)

    handlers.update({op: seen(h) for op, h in original.items()})
    loss._propagate_tensor_meta = global_meta
    try:
        yield
    finally:
        handlers.update(original)
        loss._propagate_tensor_meta = meta


@contextlib.contextmanager
def waits_return_their_input():
    """``funcol.wait_tensor`` (torch/distributed/_functional_collectives.py, which ``AsyncCollectiveTensor``'s
    ``trigger_wait`` and every eager functional collective call) returns its fake input itself. On a real
    group ``_c10d_functional::wait_tensor`` waits on the work and returns its input (c10d Functional.cpp), one
    storage; its Meta kernel (``_wait_tensor_meta``: ``empty_like``) makes a second one, so a fake trace held
    each collective's output twice from its wait until the ``AsyncCollectiveTensor`` died: the gathered logits
    (fp32, tiny Llama tp 2, B2 S64) 65,528 B over a real gloo step's allocator peak and the estimate without
    --sp, 81,912 B with it; after, all three equal. The fake group's collectives complete when issued, so there
    is nothing to wait for. Real tensors (``trace_step(real=True)``) keep the op."""
    import torch.distributed._functional_collectives as funcol
    from torch._subclasses.fake_tensor import FakeTensor

    original = funcol.wait_tensor

    def wait(tensor):
        return tensor if isinstance(tensor, FakeTensor) else original(tensor)

    funcol.wait_tensor = wait
    try:
        yield
    finally:
        funcol.wait_tensor = original
