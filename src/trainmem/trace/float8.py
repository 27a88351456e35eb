"""Float8 training in the tracer: torchao's real ``convert_to_float8_training`` on the built model.

The model's ``nn.Linear`` modules that torchtitan's filter accepts
(:func:`trainmem.estimate.float8.converted`: dims multiples of 16, the output head left out)
become torchao ``Float8Linear`` modules with ``Float8LinearConfig.from_recipe_name(impl.float8)``.
Their casts, amax reductions and ``torch._scaled_mm`` run on fake tensors and on the CPU
(torch 2.13 has a CPU ``_scaled_mm`` for both recipes), so the trace records torchao's own ops.

Under autocast, ``Float8Linear.forward`` reads CUDA's autocast state (``torch.is_autocast_enabled()``)
to cast its input; the tracer runs CPU kernels as a stand-in for a CUDA device, so
:func:`cuda_autocast_state` sets CUDA's autocast state beside CPU's: CPU ops are not affected (autocast
acts per device), and the Float8Linear takes the path it takes on a GPU.

The fp8 all-gather (``impl.float8_all_gather``, torchao's ``enable_fsdp_float8_all_gather``) runs
under the FSDP2 trace (:mod:`trainmem.trace.parallel_fsdp`): the converted weights become torchao's
``WeightWithDynamicFloat8CastTensor``, whose ``fsdp_pre_all_gather`` casts each shard to fp8 before
FSDP2 gathers it (torchao/float8/fsdp_utils.py).

Known limitations:
  - the fp8 all-gather needs FSDP2: refused on one device.
"""

from __future__ import annotations

import contextlib

from trainmem.errors import UnsupportedError

__all__ = ["Float8Autocast", "convert_float8", "cuda_autocast_state"]


def _torchao_float8():
    """torchao.float8, imported without the warnings a CPU build logs about its CUDA-only kernels."""
    import logging
    loggers = [logging.getLogger(n) for n in ("torchao", "torch.utils._pytree")]
    levels = [log.level for log in loggers]
    for log in loggers:
        log.setLevel(logging.ERROR)
    try:
        import torchao.float8 as f8
    except ImportError:
        raise UnsupportedError("float8 tracing needs torchao: pip install torchao") from None
    finally:
        for log, level in zip(loggers, levels):
            log.setLevel(level)
    return f8


def convert_float8(model, impl, *, fsdp: bool = False) -> list[str]:
    """Convert ``model`` in place as torchtitan's Float8 converter does; returns the converted
    modules' names (torchao offers the filter ``nn.Linear`` modules only). ``fsdp``: the model is
    sharded with FSDP2 next, so the fp8 all-gather can run."""
    if impl.float8_all_gather and not fsdp:
        raise UnsupportedError("float8_all_gather is FSDP2's fp8 all-gather: trace it with --dp N --fsdp full, "
                               "or without it on one device")
    from trainmem.specs.float8_filter import converted

    f8 = _torchao_float8()
    names: list[str] = []

    def accept(module, fqn: str) -> bool:
        weight = tuple(module.weight.shape)
        ok = converted(None, f"{fqn}.weight", weight)
        if ok:
            names.append(fqn)
        return ok

    config = f8.Float8LinearConfig.from_recipe_name(impl.float8)
    if impl.float8_all_gather:  # torchtitan's Float8Converter: enable_fsdp_float8_all_gather
        import dataclasses
        config = dataclasses.replace(config, enable_fsdp_float8_all_gather=True)
    f8.convert_to_float8_training(model, module_filter_fn=accept, config=config)
    return names


@contextlib.contextmanager
def cuda_autocast_state(dtype):
    """CUDA's autocast flag and dtype set as ``torch.autocast('cuda', dtype)`` would set them
    (see the module docstring); restored on exit."""
    import torch
    enabled, old = torch.is_autocast_enabled("cuda"), torch.get_autocast_dtype("cuda")
    torch.set_autocast_enabled("cuda", True)
    torch.set_autocast_dtype("cuda", dtype)
    try:
        yield
    finally:
        torch.set_autocast_enabled("cuda", enabled)
        torch.set_autocast_dtype("cuda", old)


class Float8Autocast:
    """``autocast`` (the step's CPU autocast context) entered together with
    :func:`cuda_autocast_state`; reusable, as the step enters it once per micro-batch."""

    def __init__(self, autocast, dtype) -> None:
        self.autocast, self.dtype = autocast, dtype
        self._stack: list[contextlib.ExitStack] = []

    def __enter__(self):
        stack = contextlib.ExitStack()
        stack.enter_context(self.autocast)
        stack.enter_context(cuda_autocast_state(self.dtype))
        self._stack.append(stack)
        return self

    def __exit__(self, *exc) -> None:
        self._stack.pop().close()
