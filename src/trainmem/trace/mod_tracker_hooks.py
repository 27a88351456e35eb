"""The recorder's ``ModTracker`` without the reference cycles its backward hooks leave behind.

``ModTracker._fw_pre_hook`` (torch/distributed/_tools/mod_tracker.py) registers, on a module's inputs that
require a gradient, an ``all``-mode ``register_multi_grad_hook`` (torch/autograd/graph.py) and never removes
it. Each of its per-tensor hooks closes over ``grad_fns``: the inputs' ``grad_fn`` or, for a leaf, its
``AccumulateGrad``. The hooks live in the tensor's ``_backward_hooks`` dict, which ``Tensor.register_hook``
(torch/_tensor.py) hands to the tensor's ``grad_fn`` (a non-leaf) or keeps on the tensor (a leaf). So a
non-leaf's node holds, through C++, the dict that holds the node; a leaf holds its ``AccumulateGrad``, whose
``variable`` is the leaf. The garbage collector cannot see the C++ edges: a leaf that requires a gradient
and is no parameter (the embedding output transformers makes one under checkpointing,
``PreTrainedModel.enable_input_require_grads``) outlives its micro-batch with its ``.grad`` even after
``gc.collect()``, where a step without ``ModTracker`` frees both when the loss dies; the leaked non-leaf
nodes come free one graph level per collection. The hook has done its work once it has fired, so each
``all``-mode hook is removed when the backward that fired it ends (``queue_callback``: never inside the
hook loop that calls it); any that never fired are removed when the recorder exits.
"""

from __future__ import annotations

import itertools

import torch
import torch.distributed._tools.mod_tracker as _mod_tracker

__all__ = ["ReleasedMultiGradHooks"]


class ReleasedMultiGradHooks:
    """Within the block, ``ModTracker`` registers its multi-grad hooks through :meth:`_register`."""

    def __init__(self) -> None:
        self._pending: dict[int, object] = {}  # number -> handle of an all-mode hook not fired yet
        self._numbers = itertools.count()
        self._register_multi_grad_hook = None

    def __enter__(self) -> "ReleasedMultiGradHooks":
        self._register_multi_grad_hook = _mod_tracker.register_multi_grad_hook
        _mod_tracker.register_multi_grad_hook = self._register
        return self

    def __exit__(self, *exc) -> None:
        if self._register_multi_grad_hook is not None:  # the recorder exits here even where it failed to enter
            _mod_tracker.register_multi_grad_hook = self._register_multi_grad_hook
            self._register_multi_grad_hook = None
        for handle in self._pending.values():
            handle.remove()
        self._pending.clear()

    def _register(self, tensors, fn, *, mode="all"):
        if mode != "all":  # ``any``-mode hooks close over no autograd node: no cycle
            return self._register_multi_grad_hook(tensors, fn, mode=mode)
        key = next(self._numbers)

        def fired(grads) -> None:
            fn(grads)
            done = self._pending.pop(key, None)
            if done is not None:
                torch.autograd.Variable._execution_engine.queue_callback(done.remove)

        self._pending[key] = handle = _all_mode_hook(tensors, fired)
        return handle


def _all_mode_hook(tensors, fn):
    """torch's ``all``-mode ``register_multi_grad_hook`` (torch/autograd/graph.py) less its buffer: torch's keeps
    each input's gradient (``buffer[id][idx] = grad``) until the last input's arrives, so under ModTracker a
    module's first input gradient outlived its consumer (BERT's ``BertOutput(hidden_states, input_tensor)``: the
    dense projection's input gradient held to the residual sum, 8,192 B over a real step in bf16 B1 S64). ModTracker's
    hooks read no gradient (``_get_pop_fn``), so ``fn`` gets ``None`` for each: the count alone decides when."""
    from torch.autograd.graph import _get_grad_fn_or_grad_acc, _MultiHandle

    grad_fns, n = [_get_grad_fn_or_grad_acc(t) for t in tensors], len(tensors)  # never the tensors themselves
    count: dict[int, int] = {}
    calls: dict[int, int] = {}

    def inner(_grad) -> None:
        task = torch._C._current_graph_task_id()
        if task not in count:  # which inputs this backward reaches, known once it runs (as torch's)
            count[task], calls[task] = 0, sum(map(torch._C._will_engine_execute_node, grad_fns))
        count[task] += 1
        if count[task] == calls[task]:
            del count[task], calls[task]
            fn([None] * n)

    return _MultiHandle(tuple(t.register_hook(inner) for t in tensors))
