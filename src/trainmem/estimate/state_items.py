"""One parameter's model-state items: the item itself and its optimizer states.

Shared by ``model_states.py`` (every parameter) and ``finetune.py`` (adapters, frozen and
quantized bases), so that neither imports the other for them.
"""

from __future__ import annotations

import math

from trainmem.inventory import Category, MemoryItem, dtype_bytes
from trainmem.specs import StepSpec

__all__ = ["state_item", "optimizer_state_items"]

# bitsandbytes' 8-bit optimizers: tensors under min_8bit_size keep fp32 states; larger ones are
# quantized blockwise, one fp32 absmax per 256 values
_BNB_BLOCK = 256
_BNB_MIN_8BIT = 4096


def state_item(name, category, shape, dtype, formula, numel=None) -> MemoryItem:
    n = math.prod(shape) if numel is None else numel
    return MemoryItem.make(name, category, tuple(shape), dtype, int(n * dtype_bytes(dtype)), formula)


def optimizer_state_items(name: str, shape: tuple[int, ...], step: StepSpec, dt: str | None = None) -> list[MemoryItem]:
    """The optimizer states of parameter ``name``; ``dt`` overrides the states' dtype."""
    opt, dt = step.optimizer, dt or step.dtypes.state  # dt: LoRA adapters keep states like their weights
    b = dtype_bytes(dt)
    n = math.prod(shape)
    S = Category.OPTIMIZER_STATE
    if opt in ("adamw", "adam"):
        return [state_item(f"{name}.exp_avg", S, shape, dt, f"numel·{b:g}"),
                state_item(f"{name}.exp_avg_sq", S, shape, dt, f"numel·{b:g}")]
    if opt == "sgd-momentum":
        return [state_item(f"{name}.momentum_buffer", S, shape, dt, f"numel·{b:g}")]
    if opt == "sgd":
        return []
    if opt == "adafactor":
        if len(shape) >= 2:
            row, col = shape[:-1], shape[:-2] + shape[-1:]
            return [state_item(f"{name}.exp_avg_sq_row", S, row, dt, f"rows·{b:g}"),
                    state_item(f"{name}.exp_avg_sq_col", S, col, dt, f"cols·{b:g}")]
        return [state_item(f"{name}.exp_avg_sq", S, shape, dt, f"numel·{b:g}")]
    # adam8bit
    if n < _BNB_MIN_8BIT:
        return [state_item(f"{name}.state1", S, shape, "float32", "numel·4"),
                state_item(f"{name}.state2", S, shape, "float32", "numel·4")]
    blocks = -(-n // _BNB_BLOCK)
    return [state_item(f"{name}.state1", S, shape, "uint8", "numel·1"),
            state_item(f"{name}.state2", S, shape, "uint8", "numel·1"),
            state_item(f"{name}.absmax1", S, (blocks,), "float32", "⌈numel/256⌉·4"),
            state_item(f"{name}.absmax2", S, (blocks,), "float32", "⌈numel/256⌉·4")]
