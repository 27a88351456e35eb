"""Trace a training step: every storage allocation and free, without a GPU.

``trace(model, optimizer)`` is a context manager for any PyTorch model; ``trace_step``
builds a Hugging Face model from its config (on fake tensors by default), runs two
training steps and records the second; ``trace_model`` does the same for your own ``nn.Module``
and step function. torch is imported only when these are used.
"""

from __future__ import annotations

__all__ = ["trace", "trace_step", "trace_model", "Tracer", "TraceResult", "ModulePeak", "LiveTensor", "SCHEMA"]


def __getattr__(name: str):
    if name in ("trace", "Tracer"):
        from trainmem.trace import api
        return getattr(api, name)
    if name == "trace_step":
        from trainmem.trace.step import trace_step
        return trace_step
    if name == "trace_model":
        from trainmem.trace.model import trace_model
        return trace_model
    if name in ("TraceResult", "ModulePeak", "LiveTensor", "SCHEMA"):
        from trainmem.trace import result
        return getattr(result, name)
    raise AttributeError(f"module 'trainmem.trace' has no attribute {name!r}")
