"""trace/mod_tracker_hooks.py: ``ModTracker``'s all-mode multi-grad hooks are removed once fired, so a
leaf that requires a gradient and is no parameter (transformers' embedding output under checkpointing)
dies with the loss, as in a step without ``ModTracker``, and no hook is left behind."""

from __future__ import annotations

import gc
import weakref

import pytest

torch = pytest.importorskip("torch")

from torch.distributed._tools import mod_tracker  # noqa: E402

from trainmem.trace.mod_tracker_hooks import ReleasedMultiGradHooks  # noqa: E402


def _step(model, keep):
    x = torch.ones(2, 8).requires_grad_()  # a leaf that requires a gradient, as enable_input_require_grads makes
    keep.append(weakref.ref(x))
    loss = model(x).sum()
    loss.backward()
    return x


def test_the_leaf_dies_with_the_loss_and_no_hook_stays():
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 4))
    original = mod_tracker.register_multi_grad_hook
    calls, refs = [], []
    tracker = mod_tracker.ModTracker()
    tracker.register_user_hooks(post_bw_hook=lambda mod, grads: calls.append(type(mod).__name__))
    enabled = gc.isenabled()
    gc.disable()  # freed by reference counting, as when the loss dies in a real step
    try:
        with ReleasedMultiGradHooks(), tracker:
            x = _step(model, refs)
            assert x.grad is not None and not x._backward_hooks  # fired, then removed when backward ended
            del x
            assert refs[-1]() is None
            x = _step(model, refs)  # a second micro-batch sees the hooks again
            del x
            assert refs[-1]() is None
    finally:
        if enabled:
            gc.enable()
    # each module's post-backward hook still ran, once per backward
    assert calls.count("Sequential") == 2 and calls.count("Linear") == 4
    assert mod_tracker.register_multi_grad_hook is original


def test_hooks_that_never_fired_are_removed_on_exit():
    x = torch.ones(3).requires_grad_()
    with ReleasedMultiGradHooks(), mod_tracker.ModTracker():
        torch.nn.Linear(3, 3)(x)  # a forward with no backward: the all-mode hook on x never fires
        assert len(x._backward_hooks) == 1
    assert not x._backward_hooks
