"""``trace_model``: trace your own ``nn.Module`` on fake tensors, a warm-up step then a recorded one.

``model_factory()`` builds the model, ``batch_factory()`` (optional) the step's inputs, and
``optimizer_factory(model)`` the optimizer (default: ``torch.optim.AdamW(model.parameters(),
lr=1e-4, foreach=True)``, the implementation torch picks for CUDA parameters in
``torch/optim/adam.py`` ``adam()`` through ``optimizer.py`` ``_default_to_fused_or_foreach``; on
CPU tensors torch would pick the per-tensor loop). All three run under ``FakeTensorMode``: no
weights, no activations, only shapes, dtypes and storages, so a 7B model costs no host memory.

``step_fn(model, optimizer, batch)`` (``step_fn(model, optimizer)`` without ``batch_factory``) is
one training step written by you: forward, backward, ``optimizer.step()``, ``zero_grad``. It runs
twice. The first call creates the optimizer state; the second is recorded with everything alive
at its start (parameters, buffers, gradients kept by the first step, optimizer state) as the
baseline, as ``trace_step`` does for Hugging Face models.

Known limitations:
  - Data-dependent ops cannot run on fake tensors: ``loss.item()``, ``print(loss)``, ``nonzero``,
    boolean-mask indexing, Python branches on tensor values. Log outside ``step_fn``, or trace
    with ``real=True`` at a small size.
  - The factories build on the CPU: ``.cuda()``/``.to("cuda")`` inside them cannot run, and CUDA-only
    kernels (flash attention, bitsandbytes, Triton) have no CPU implementation.
  - ``model.to(dtype)`` cannot swap fake parameters; pass ``dtype=`` (the default dtype while the
    factories run) instead.
  - Weight initialisation that reads values (a data-dependent check, ``orthogonal_``'s sign fix on
    some versions) fails under fake tensors; the error names ``model_factory``.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable

from trainmem.errors import UnsupportedError
from trainmem.trace.result import TraceResult

__all__ = ["trace_model"]

_DTYPES = ("float32", "bfloat16", "float16")


def _tensors(batch: Any) -> list:
    """The distinct tensors in a batch (a tensor, or dicts, lists and tuples of them)."""
    import torch
    found: dict[int, Any] = {}
    stack = [batch]
    while stack:
        x = stack.pop()
        if isinstance(x, torch.Tensor):
            found.setdefault(id(x), x)
        elif isinstance(x, dict):
            stack.extend(x.values())
        elif isinstance(x, (list, tuple)):
            stack.extend(x)
    return list(found.values())


@contextlib.contextmanager
def _refusals(where: str):
    """Fake-tensor failures as one-line errors naming the user function they came from."""
    from torch._subclasses import fake_tensor as ft
    try:
        yield
    except (ft.DynamicOutputShapeException, ft.DataDependentOutputException) as exc:
        raise UnsupportedError(f"{where} runs {exc.func}, whose result depends on tensor values (.item(), "
                               "nonzero, a branch on a value): fake tensors have none; move it out of "
                               f"{where} or trace with real=True at a small size") from None
    except ft.UnsupportedOperatorException as exc:
        raise UnsupportedError(f"{where} runs {exc.func}, which has no fake-tensor implementation; "
                               "trace with real=True") from None


def trace_model(model_factory: Callable[[], Any], step_fn: Callable[..., Any], *,
                optimizer_factory: Callable[[Any], Any] | None = None,
                batch_factory: Callable[[], Any] | None = None, dtype: str = "float32",
                real: bool = False, progress: Callable[[float, str], None] | None = None) -> TraceResult:
    """Trace the second of two calls of ``step_fn`` on the model ``model_factory`` builds.

    See the module docstring. ``real=True`` runs the same on real CPU tensors (to check the fake
    run, at a small size). ``dtype`` is the default dtype while the factories run.
    """
    if dtype not in _DTYPES:
        from trainmem.errors import SpecError
        raise SpecError("dtype", dtype, f"one of {', '.join(_DTYPES)}")
    try:
        import torch
        from torch._subclasses.fake_tensor import FakeTensorMode
    except ImportError:  # pragma: no cover
        raise UnsupportedError("tracing needs torch: pip install 'trainmem[torch]'") from None
    if isinstance(model_factory, torch.nn.Module) or not callable(model_factory):
        raise UnsupportedError(f"model_factory={type(model_factory).__name__} object: pass a function that builds "
                               "the model (lambda: MyModel(cfg)), so that it is built on fake tensors")
    from trainmem.trace.api import Tracer
    from trainmem.trace.hf_masks import masks_as_on_real_tensors
    from trainmem.trace.torch_state import default_dtype, quiet_fake_tensor_log

    mode = contextlib.nullcontext() if real else FakeTensorMode()
    with quiet_fake_tensor_log(), mode, masks_as_on_real_tensors():
        with _refusals("model_factory"), default_dtype(getattr(torch, dtype)):
            model = model_factory()
            batch = batch_factory() if batch_factory is not None else None
            optimizer = (optimizer_factory(model) if optimizer_factory is not None
                         else torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True))
        model.train()
        args = (model, optimizer) if batch_factory is None else (model, optimizer, batch)
        with _refusals("step_fn"):
            step_fn(*args)  # warm-up: creates the optimizer state
            meta = {"model": type(model).__name__, "fake": not real, "dtype": dtype,
                    "optimizer": type(optimizer).__name__, "torch": torch.__version__,
                    "step": {"precision": dtype, "optimizer": type(optimizer).__name__}}
            tracer = Tracer(model, optimizer, inputs=_tensors(batch), meta=meta, progress=progress)
            with tracer:
                step_fn(*args)
    return tracer.result
