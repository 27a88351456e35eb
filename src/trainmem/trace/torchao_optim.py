"""torchao's AdamW8bit / AdamW4bit in the tracer: the real optimizer and its real compiled step.

torchao 0.18 steps each parameter through ``torch.compile(single_param_adam, fullgraph=True,
dynamic=False)`` (torchao/optim/adam.py ``_AdamBase.step``), with states that are tensor subclasses
(``OptimState8bit``: uint8 ``codes``, fp32 ``scale`` per block, a ``qmap``; ``OptimState4bit``: packed
codes). What the step holds is what inductor's generated wrapper allocates (``empty_strided_cpu``
buffers, freed by ``del``), which a dispatch mode does not see: ``_empty_strided_cpu`` is a C++
function (torch._C._dynamo.guards) that bypasses the dispatcher. Three things make it traceable:

* the quantization maps are built by ``create_dynamic_map`` (torchao/optim/quant_utils.py), which
  calls ``.tolist()``; they are ``lru_cache``'d (subclass_8bit/subclass_4bit ``get_qmap_signed`` /
  ``get_qmap_unsigned``), so they are built once with fake tensors switched off, and the states are
  then made on fake tensors by torchao itself;
* while the optimizer steps, the generated wrapper's ``empty_strided_cpu`` is
  ``torch.empty_strided`` (and ``reinterpret_tensor`` ``torch.as_strided``), so its buffers pass
  through the dispatcher: the recorder sees each one allocated and freed where the generated code
  does it;
* on fake tensors inductor's C++ kernels cannot run (they read data pointers: torch 2.13 warns
  "Accessing the data pointer of FakeTensor" and the process dies with SIGSEGV, checked), so each
  ``cpp_pybinding`` kernel is a no-op there and is never compiled; everything else (dynamo,
  AOTAutograd's subclass flattening, inductor's scheduling and memory planning, the wrapper code) is
  torch's own. With real tensors the kernels compile and run.

The step runs a private copy of ``single_param_adam``, one for fake and one for real tensors (their
own code objects, so dynamo's caches of these compilations are shared with nothing else), and the generated modules loaded while it
steps are dropped from inductor's module cache afterwards, so a later real compilation of the same
source never reuses a module holding no-op kernels.

Known limitations:
  - CUDA's generated code may keep fewer buffers than the CPU code traced here, and CUDA's first call
    benchmarks kernels on clones of the arguments they write (``CachingAutotuner.maybe_clone_args``),
    not traced (see estimate/optimizer_step.py ``_torchao_rule``).
  - Each distinct parameter shape compiles once (``dynamic=False``): seconds per shape on CPU.
"""

from __future__ import annotations

import contextlib
import functools
import types

from trainmem.errors import UnsupportedError

__all__ = ["make_torchao_traced", "state_parts"]


def state_parts(v) -> list[tuple[str, object]] | None:
    """``[(".codes", t), (".scale", t), (".qmap", t)]`` for a torchao optimizer state subclass, named
    as the estimator names them (estimate/state_items.py); None for a plain tensor."""
    attrs = getattr(type(v), "tensor_attrs", None)
    if attrs is None or not type(v).__module__.startswith("torchao.optim"):
        return None
    return [(f".{a}", getattr(v, a)) for a in attrs]


def _build_qmaps() -> None:
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    from torchao.optim import subclass_4bit, subclass_8bit

    with unset_fake_temporarily():
        for module in (subclass_8bit, subclass_4bit):
            module.get_qmap_signed()
            module.get_qmap_unsigned()


@functools.lru_cache(maxsize=None)
def _private_single_param_adam(fake: bool):
    """A copy per mode: dynamo never offers a real step the no-op kernels compiled for fake tensors."""
    from torchao.optim import adam
    f = adam.single_param_adam
    return types.FunctionType(f.__code__.replace(), f.__globals__, f.__name__, f.__defaults__, f.__closure__)


@contextlib.contextmanager
def _inductor_buffers_dispatched(fake: bool):
    """Inductor's wrapper allocating through the dispatcher; no-op kernels on fake tensors (above)."""
    import torch
    from torch._inductor.async_compile import AsyncCompile
    from torch._inductor.codecache import PyCodeCache
    from torchao.optim import adam

    guards = torch._C._dynamo.guards
    saved = (guards._empty_strided_cpu, guards._reinterpret_tensor, AsyncCompile.cpp_pybinding, adam.single_param_adam)
    before = set(PyCodeCache.modules_no_attr)
    guards._empty_strided_cpu = lambda size, stride, dtype: torch.empty_strided(size, stride, dtype=dtype)
    guards._reinterpret_tensor = lambda t, size, stride, offset: torch.as_strided(t, size, stride, offset)
    if fake:
        AsyncCompile.cpp_pybinding = lambda self, argtypes, source_code: (lambda *args: None)
    adam.single_param_adam = _private_single_param_adam(fake)
    try:
        yield
    finally:
        (guards._empty_strided_cpu, guards._reinterpret_tensor, AsyncCompile.cpp_pybinding,
         adam.single_param_adam) = saved
        for path in set(PyCodeCache.modules_no_attr) - before:
            PyCodeCache.modules_no_attr.pop(path, None)


def make_torchao_traced(cls_name: str, params, lr: float = 1e-4):
    """torchao's ``cls_name`` over ``params`` (fake or real), stepping as described above."""
    from torch._subclasses.fake_tensor import is_fake
    try:
        import torchao.optim as ao
    except ImportError:
        raise UnsupportedError(f"torchao's {cls_name} is traced with torchao itself: pip install torchao") from None
    params = list(params)
    _build_qmaps()
    opt = getattr(ao, cls_name)(params, lr=lr)
    fake = any(is_fake(p) for p in params)
    step = opt.step  # torch.optim's hooked step (the recorder's optimizer phase)

    def traced_step(*args, **kwargs):
        with _inductor_buffers_dispatched(fake):
            return step(*args, **kwargs)

    opt.step = traced_step
    return opt
