"""bitsandbytes' 8-bit and paged optimizers for the tracer, on fake or real CPU tensors.

bitsandbytes 0.50 runs its optimizers on CPU (``bitsandbytes/backends/cpu``) and registers fake
kernels for their update ops (``bitsandbytes/_ops.py``: ``optimizer_update_8bit_blockwise``,
``optimizer_update_32bit``), so the real optimizer class steps fake tensors. Only its constructor
needs real values: ``Optimizer8bit.fill_qmap`` builds the two quantization maps with ``.tolist()``.
It runs with fake tensors switched off and the maps are then remade as fake tensors.

Known limitations:
  - Paging needs CUDA: on CPU ``get_state_buffer`` falls back to plain tensors (and warns), so a
    trace counts paged states as optimizer state; the estimate reports them apart
    (``Category.PAGED_STATE``).
  - torchao's AdamW8bit/AdamW4bit are not traced: their quantization reads tensor values (no fake
    tensors) and their step runs inductor-generated kernels the tracer does not see;
    tests/estimate/test_optimizers_8bit.py checks their states against the real optimizer instead.
    :func:`make_torchao_optimizer` builds them for real measurements (``trainmem profile``).
"""

from __future__ import annotations

from trainmem.errors import UnsupportedError

__all__ = ["BNB_CLASSES", "TORCHAO_CLASSES", "make_bnb_optimizer", "make_torchao_optimizer"]

#: trainmem optimizer -> bitsandbytes.optim class
BNB_CLASSES = {"adam8bit": "Adam8bit", "adamw8bit": "AdamW8bit", "paged-adamw8bit": "PagedAdamW8bit",
               "paged-adamw32bit": "PagedAdamW32bit"}
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
    # get_state_buffer warns once that paging falls back on CPU: Known limitations say so instead
    opt._cpu_paged_warned = True
    return opt


def make_torchao_optimizer(name: str, params, lr: float = 1e-4):
    """torchao's ``name`` over real ``params`` (a measured step; the tracer refuses torchao)."""
    try:
        import torchao.optim as ao
    except ImportError:
        raise UnsupportedError(f"optimizer={name!r} is torchao's: pip install torchao") from None
    return getattr(ao, TORCHAO_CLASSES[name])(list(params), lr=lr)
