"""One parameter's model-state items: the item itself and its optimizer states.

Shared by ``model_states.py`` (every parameter) and ``finetune.py`` (adapters, frozen and
quantized bases), so that neither imports the other for them. Each optimizer's state layout is
one registered function of (name, shape, numel, states' dtype), read off the real implementation:

* torch ``AdamW``/``Adam``: ``exp_avg`` and ``exp_avg_sq`` like the parameter (``step`` is a CPU
  scalar unless capturable/fused); ``SGD(momentum)``: ``momentum_buffer``; Adafactor (transformers):
  factored row/column second moments for matrices.
* bitsandbytes 0.50 (``bitsandbytes/optim/optimizer.py``, ``Optimizer2State.init_state``): a tensor
  under ``min_8bit_size`` (4096) values keeps fp32 ``state1``/``state2``; a larger one uint8 states
  plus one fp32 ``absmax`` per 256-value block (``blocks = n // 256 + bool(n % 256)``). The two
  256-entry fp32 quantization maps (``name2qmap['dynamic']``/``['udynamic']``) are one pair per
  optimizer, shared by every parameter's ``qmap1``/``qmap2`` (:func:`shared_state_items`). States are
  fp32 or uint8 whatever the parameter's dtype. Paged optimizers (``is_paged``) take ``state1`` and
  ``state2`` of tensors of 1e5 values or more from ``F.get_paged`` -- CUDA unified memory, outside
  PyTorch's allocator (``Optimizer8bit.get_state_buffer``): :data:`Category.PAGED_STATE`; ``absmax``
  stays a ``torch.zeros`` device tensor. The one-state optimizers (``Optimizer1State.init_state``:
  ``Lion``, ``RMSprop`` and their 8-bit, 32-bit and paged classes) keep ``state1`` alone, with
  ``absmax1`` and the signed map ``qmap1`` (only ``name2qmap['dynamic']`` goes to the device).
  ``AdEMAMix`` (``optim/ademamix.py``, ``init_state``): ``state1`` holds both momenta, ``(2, *p.shape)``,
  with ``absmax1`` ``(2, blocks)``; ``state2`` and ``absmax2`` as Adam's.
* torch ``RMSprop`` (``torch/optim/rmsprop.py``, ``_init_group``): ``square_avg`` like the parameter
  (``momentum_buffer`` with momentum, ``grad_avg`` when centered: not modelled, the readers refuse
  them); ``Adagrad`` (``adagrad.py``, ``__init__``, made with the optimizer, not at its first step):
  ``sum``, ``torch.full_like(p, initial_accumulator_value)``. Their ``step`` is a 0-dim tensor, on the
  host unless capturable or fused.
* torchao 0.18 (``torchao/optim/adam.py``, ``_AdamBase._new_buffer``): a tensor of 4096 values or more
  whose size is a multiple of the block is quantized (``OptimState8bit``: uint8 ``codes`` like the
  tensor, fp32 ``scale`` per 256-value block, its own 256-entry fp32 ``qmap``; ``OptimState4bit``:
  two 4-bit codes per byte, fp32 ``scale`` per 128-value block, a 16-entry ``qmap``); any other keeps
  ``torch.zeros_like(p)`` states in the parameter's dtype. Its ``step`` is ``torch.tensor(0.0)``, a
  CPU scalar, so it takes no device memory.

Known limitations: one optimizer is assumed (with the optimizer in backward every parameter has its
own bitsandbytes optimizer and maps: 1 KiB (one state) or 2 KiB more per 8-bit tensor); sharded
states (TP, ZeRO, FSDP) are divided, not re-laid out per shard; paged AdEMAMix (its state1 paged by
``F.get_paged`` directly) and RMSprop's momentum/centered states are not laid out (the readers refuse
them).
"""

from __future__ import annotations

import math
from typing import Callable

from trainmem.inventory import Category, MemoryItem, dtype_bytes
from trainmem.specs import StepSpec

__all__ = ["state_item", "optimizer_state_items", "shared_state_items", "BNB", "BNB_8BIT", "TORCHAO"]

S, PAGED = Category.OPTIMIZER_STATE, Category.PAGED_STATE
_BNB_BLOCK = 256  # optimizer.py, Optimizer2State.init_state: blocksize = 256
_BNB_MIN_8BIT = 4096  # min_8bit_size's default
_BNB_MIN_PAGED = 100_000  # get_state_buffer: `not self.is_paged or p.numel() < 1e5` -> a plain device tensor
_BNB_QMAP = 256  # functional.create_dynamic_map: 256 values, fp32
_TORCHAO_MIN = 4096  # adam.py, _new_buffer: "follow bitsandbytes, only quantize tensors >= 4096 values"
#: torchao optimizer -> (block size, codes per byte, qmap entries): AdamW8bit(block_size=256) and
#: AdamW4bit(block_size=128); subclass_8bit.get_qmap_signed: 256 entries, subclass_4bit's: 16.
#: transformers' adamw_torch_4bit builds AdamW4bit(block_size=256) (trainer_optimizer.py, _get_torchao_optimizer)
TORCHAO = {"torchao-adamw8bit": (256, 1, 256), "torchao-adamw4bit": (128, 2, 16),
           "torchao-adamw4bit-block256": (256, 2, 16)}
#: bitsandbytes optimizer -> (states per tensor, bits, paged, copies in state1): ``Optimizer2State``
#: (Adam) keeps two, ``Optimizer1State`` (Lion, RMSprop) one; ``optim_bits`` and ``is_paged`` as its
#: class sets them. ``AdEMAMix.init_state`` (``optim/ademamix.py``) makes ``state1`` of shape
#: ``(2, *p.shape)``, the fast and the slow momentum, with ``absmax1`` of ``(2, blocks)``.
BNB = {"adam8bit": (2, 8, False, 1), "adamw8bit": (2, 8, False, 1), "paged-adamw8bit": (2, 8, True, 1),
       "paged-adamw32bit": (2, 32, True, 1), "lion32bit": (1, 32, False, 1), "lion8bit": (1, 8, False, 1),
       "paged-lion8bit": (1, 8, True, 1), "paged-lion32bit": (1, 32, True, 1), "rmsprop8bit": (1, 8, False, 1),
       "rmsprop32bit": (1, 32, False, 1), "ademamix": (2, 32, False, 2), "ademamix8bit": (2, 8, False, 2)}
#: bitsandbytes optimizers with 8-bit blockwise states
BNB_8BIT = tuple(name for name, (_, bits, _, _) in BNB.items() if bits == 8)

Layout = Callable[[str, tuple, int, str], list[MemoryItem]]
_LAYOUTS: dict[str, Layout] = {}


def _layout(*names: str) -> Callable[[Layout], Layout]:
    def register(fn: Layout) -> Layout:
        for n in names:
            if n in _LAYOUTS:
                raise ValueError(f"duplicate optimizer state layout for {n!r}")
            _LAYOUTS[n] = fn
        return fn
    return register


def state_item(name, category, shape, dtype, formula, numel=None) -> MemoryItem:
    n = math.prod(shape) if numel is None else numel
    return MemoryItem.make(name, category, tuple(shape), dtype, int(n * dtype_bytes(dtype)), formula)


def optimizer_state_items(name: str, shape: tuple[int, ...], step: StepSpec, dt: str | None = None) -> list[MemoryItem]:
    """The optimizer states of parameter ``name``; ``dt`` overrides the states' dtype (bitsandbytes
    keeps fp32 or uint8 states whatever it is)."""
    dt = dt or step.dtypes.state  # dt: LoRA adapters keep states like their weights
    return _LAYOUTS[step.optimizer](name, tuple(shape), math.prod(shape), dt)


def shared_state_items(step: StepSpec, states: list[MemoryItem]) -> list[MemoryItem]:
    """States one optimizer keeps once, whatever its parameters: bitsandbytes' quantization maps
    (``name2qmap``, moved to the device by the first 8-bit tensor: both for a two-state optimizer,
    the signed one for a one-state), when any tensor has 8-bit states."""
    if step.optimizer not in BNB_8BIT or not any(it.dtype == "uint8" and it.category in (S, PAGED) for it in states):
        return []
    return [state_item(f"optimizer.qmap{i}", S, (_BNB_QMAP,), "float32", f"{_BNB_QMAP}·4")
            for i in range(1, BNB[step.optimizer][0] + 1)]


def _like_param(*keys: str) -> Layout:
    """torch's states made ``torch.zeros_like(p)`` (or ``full_like``): one per key, the parameter's shape."""
    def layout(name, shape, n, dt):
        return [state_item(f"{name}.{k}", S, shape, dt, f"numel·{dtype_bytes(dt):g}") for k in keys]
    return layout


_adam = _layout("adamw", "adam")(_like_param("exp_avg", "exp_avg_sq"))
_layout("sgd-momentum")(_like_param("momentum_buffer"))
_layout("sgd")(_like_param())
_layout("rmsprop")(_like_param("square_avg"))
_layout("adagrad")(_like_param("sum"))


@_layout("adafactor")
def _adafactor(name, shape, n, dt):
    b = dtype_bytes(dt)
    if len(shape) >= 2:
        row, col = shape[:-1], shape[:-2] + shape[-1:]
        return [state_item(f"{name}.exp_avg_sq_row", S, row, dt, f"rows·{b:g}"),
                state_item(f"{name}.exp_avg_sq_col", S, col, dt, f"cols·{b:g}")]
    return [state_item(f"{name}.exp_avg_sq", S, shape, dt, f"numel·{b:g}")]


def _bnb_layout(states: int, bits: int, paged: bool, first: int) -> Layout:
    """States of fp32 or uint8 whatever the parameter's dtype (``init_state``); ``state1`` (and
    ``absmax1``) ``first`` times over."""
    def layout(name, shape, n, dt):
        where = PAGED if paged and n >= _BNB_MIN_PAGED else S
        copies = {i: (first,) if i == 1 and first > 1 else () for i in range(1, states + 1)}
        x = {i: f"{first}·" if c else "" for i, c in copies.items()}
        if bits == 32 or n < _BNB_MIN_8BIT:
            return [state_item(f"{name}.state{i}", where, c + shape, "float32", f"{x[i]}numel·4")
                    for i, c in copies.items()]
        blocks = -(-n // _BNB_BLOCK)
        return [*(state_item(f"{name}.state{i}", where, c + shape, "uint8", f"{x[i]}numel·1") for i, c in copies.items()),
                *(state_item(f"{name}.absmax{i}", S, c + (blocks,), "float32", f"{x[i]}⌈numel/{_BNB_BLOCK}⌉·4")
                  for i, c in copies.items())]
    return layout


for _name, _spec in BNB.items():
    _layout(_name)(_bnb_layout(*_spec))


def _torchao_layout(block: int, per_byte: int, qmap: int) -> Layout:
    def layout(name, shape, n, dt):
        if n < _TORCHAO_MIN or n % block:
            return _adam(name, shape, n, dt)
        out = []
        for s in ("exp_avg", "exp_avg_sq"):
            codes = (n // per_byte,) if per_byte > 1 else shape
            packed = f"numel/{per_byte}·1" if per_byte > 1 else "numel·1"
            out += [state_item(f"{name}.{s}.codes", S, codes, "uint8", packed),
                    state_item(f"{name}.{s}.scale", S, (n // block,), "float32", f"numel/{block}·4"),
                    state_item(f"{name}.{s}.qmap", S, (qmap,), "float32", f"{qmap}·4")]
        return out
    return layout


for _name, (_block, _per_byte, _qmap) in TORCHAO.items():
    _layout(_name)(_torchao_layout(_block, _per_byte, _qmap))
