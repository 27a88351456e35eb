"""Context managers over torch's process-wide state that the tracers and the measured workload
share: the default dtype a model is built under, and FakeTensorMode's logger; and the torch dtype
of a spec's dtype name."""

from __future__ import annotations

import contextlib

__all__ = ["default_dtype", "quiet_fake_tensor_log", "torch_dtype"]


def torch_dtype(name: str):
    """The torch dtype of a spec's dtype name (``float32``, ``bfloat16``, ``float16``)."""
    import torch
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


@contextlib.contextmanager
def default_dtype(dtype):
    """``torch.set_default_dtype(dtype)`` for the block, the previous default restored after it
    (a model built under fake tensors cannot be cast with ``.to()`` afterwards)."""
    import torch

    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


@contextlib.contextmanager
def quiet_fake_tensor_log():
    """FakeTensorMode logs a traceback before raising; the caller's one-line error is enough."""
    import logging

    log = logging.getLogger("torch._subclasses.fake_tensor")
    level = log.level
    log.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        log.setLevel(level)
