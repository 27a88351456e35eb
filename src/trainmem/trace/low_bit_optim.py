"""bitsandbytes' 8-bit and paged optimizers for the tracer, on fake or real CPU tensors.

bitsandbytes 0.50 runs its optimizers on CPU (``bitsandbytes/backends/cpu``) and registers fake
kernels for their update ops (``bitsandbytes/_ops.py``: ``optimizer_update_8bit_blockwise``,
``optimizer_update_32bit``), so the real optimizer class steps fake tensors. Only its constructor
needs real values: ``Optimizer8bit.fill_qmap`` builds the two quantization maps with ``.tolist()``.
It runs with fake tensors switched off and the maps are then remade as fake tensors.

Paged states (``PagedAdamW8bit``, ``PagedAdamW32bit``, ``PagedLion8bit``, ``PagedLion32bit``): on
CUDA ``Optimizer8bit.get_state_buffer`` (``bitsandbytes/optim/optimizer.py``) takes a state of a parameter of 1e5 values or more from
``F.get_paged`` (``bitsandbytes/functional.py``: ``cget_managed_ptr``, i.e. ``cudaMallocManaged``),
CUDA unified memory outside PyTorch's caching allocator; smaller ones are ``torch.zeros_like`` on
the device. On CPU it falls back to plain tensors for all of them. The tracer runs that CUDA branch
instead (:func:`_cuda_state_buffer`): the buffer is made under :func:`paged_allocation`, which the
recorder sees, and tagged (:func:`is_paged_state`), so the trace keeps it out of the allocated and
reserved figures and reports it as ``Category.PAGED_STATE``, as the estimate does. On real CPU
tensors the buffer is the same ``zeros_like`` the fallback makes: a measured CPU step holds it.

Known limitations:
  - The managed buffer's own rounding (driver pages) is not modelled: paged bytes are logical.

torchao's AdamW8bit/AdamW4bit: :func:`make_torchao_optimizer` is the real optimizer, stepping through
its real compiled step with inductor's buffers visible (and its kernels skipped on fake tensors):
:mod:`trainmem.trace.torchao_optim`.
"""

from __future__ import annotations

from trainmem.errors import UnsupportedError
from trainmem.trace.scoped_flag import ScopedFlag

__all__ = ["BNB_CLASSES", "TORCHAO_CLASSES", "make_bnb_optimizer", "make_torchao_optimizer",
           "paged_allocation", "allocating_paged", "is_paged_state", "BNB_MIN_PAGED_NUMEL"]

#: ``get_state_buffer``: ``if not self.is_paged or p.numel() < 1e5`` -> a plain device tensor
BNB_MIN_PAGED_NUMEL = 100_000
_PAGED_TAG = "_trainmem_paged"  # not bitsandbytes' ``is_paged``: that one makes prefetch_state call cprefetch
_flag = ScopedFlag()
allocating_paged = _flag.active
"""True while a paged optimizer state is made (its storage is unified memory, not the allocator's)."""
paged_allocation = _flag.scope


def is_paged_state(t) -> bool:
    """Whether ``t`` is a state buffer the tracer made as bitsandbytes' ``F.get_paged`` would."""
    return getattr(t, _PAGED_TAG, False)


def _cuda_state_buffer(opt):
    """``Optimizer8bit.get_state_buffer``'s CUDA branch (bitsandbytes/optim/optimizer.py), for CPU
    or fake parameters: paged (tagged, made under :func:`paged_allocation`) from 1e5 values on."""
    import torch

    def get_state_buffer(p, dtype=torch.float32):
        if not opt.is_paged or p.numel() < BNB_MIN_PAGED_NUMEL:
            return torch.zeros_like(p, dtype=dtype, device=p.device)
        with paged_allocation():  # F.get_paged + F.fill(buff, 0): no caching-allocator block
            buff = torch.zeros_like(p, dtype=dtype, device=p.device)
        setattr(buff, _PAGED_TAG, True)
        return buff
    return get_state_buffer

#: trainmem optimizer -> bitsandbytes.optim class: Adam's two states (``Optimizer2State``), one state
#: (``Optimizer1State``: Lion, RMSprop), or AdEMAMix's three (``AdEMAMix``, optim_bits=32 by default,
#: as transformers builds it; not ``AdEMAMix32bit``, an ``Optimizer2State`` of Adam's layout)
BNB_CLASSES = {"adam8bit": "Adam8bit", "adamw8bit": "AdamW8bit", "paged-adamw8bit": "PagedAdamW8bit",
               "paged-adamw32bit": "PagedAdamW32bit",
               "lion32bit": "Lion32bit", "lion8bit": "Lion8bit", "paged-lion8bit": "PagedLion8bit",
               "paged-lion32bit": "PagedLion32bit", "rmsprop8bit": "RMSprop8bit", "rmsprop32bit": "RMSprop32bit",
               "ademamix": "AdEMAMix", "ademamix8bit": "AdEMAMix8bit"}
#: trainmem optimizer -> torchao.optim class
TORCHAO_CLASSES = {"torchao-adamw8bit": "AdamW8bit", "torchao-adamw4bit": "AdamW4bit"}


def make_bnb_optimizer(name: str, params, lr: float = 1e-4):
    """The bitsandbytes optimizer ``name`` over ``params`` (fake or real tensors)."""
    import torch
    from torch._subclasses.fake_tensor import is_fake, unset_fake_temporarily
    try:
        import bitsandbytes as bnb
    except ImportError:
        raise UnsupportedError(f"optimizer={name!r} is traced with bitsandbytes' own optimizer: "
                               "pip install bitsandbytes") from None
    params = list(params)
    with unset_fake_temporarily():
        opt = getattr(bnb.optim, BNB_CLASSES[name])(params, lr=lr)
    if any(is_fake(p) for p in params):  # under the tracer's FakeTensorMode: fake copies of the maps
        opt.name2qmap = {k: torch.tensor(v.tolist(), dtype=v.dtype) for k, v in opt.name2qmap.items()}
    if opt.is_paged and all(p.device.type != "cuda" for p in params):  # on CUDA bitsandbytes pages itself
        opt.get_state_buffer = _cuda_state_buffer(opt)
    return opt


def make_torchao_optimizer(name: str, params, lr: float = 1e-4):
    """torchao's ``name`` over ``params`` (fake or real tensors), traceable (trace/torchao_optim.py)."""
    from trainmem.trace.torchao_optim import make_torchao_traced
    return make_torchao_traced(TORCHAO_CLASSES[name], params, lr=lr)
