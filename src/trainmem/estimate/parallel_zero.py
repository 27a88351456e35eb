"""ZeRO/FSDP sharding and offload of model states: the group of ranks that shares one copy of
the sharded states (dp × cp, or FSDP's hybrid group), each state divided by its TP/EP divisor and,
from the ZeRO stage that shards its kind, by that group (one ceiling over the product: FSDP pads
every shard to the same size), and the states that optimizer/parameter offload moves to host.
Pure steps over an inventory, composed by :func:`trainmem.estimate.parallel.rank_classes`.
"""

from __future__ import annotations

import math

from trainmem.inventory import Category, MemoryItem, dtype_bytes
from trainmem.specs import ParallelSpec

__all__ = ["shard_group", "apply_zero", "apply_offload"]


def shard_group(par: ParallelSpec) -> int:
    """Ranks that share one copy of the sharded model states: dp × cp, or FSDP's hybrid group."""
    group = par.dp * par.cp
    if par.fsdp == "hybrid":
        group = min(group, par.fsdp_group)
    return group


def _local_item(item: MemoryItem, div: int) -> MemoryItem:
    if div == 1:
        return item
    numel = math.ceil(math.prod(item.shape) / div)  # FSDP pads every shard to the same size
    return MemoryItem.make(item.name, item.category, (numel,), item.dtype,
                           math.ceil(numel * dtype_bytes(item.dtype)), f"⌈{item.formula}/{div}⌉")


_ZERO_SHARDED = {Category.OPTIMIZER_STATE: 1, Category.PAGED_STATE: 1, Category.MASTER_WEIGHT: 1, Category.GRADIENT: 2,
                 Category.PARAMETER: 3}
"""The ZeRO stage from which each kind of model state is sharded over the data-parallel group
(stage 1: optimizer states and master weights, 2: + gradients, 3 / FSDP: + parameters)."""


def apply_zero(states, divisors: dict[str, int], *, zero: int, group: int) -> list[MemoryItem]:
    """Each state ÷ its TP/EP divisor, and ÷ ``group`` when ZeRO stage ``zero`` shards its kind
    (one ceiling over the product: FSDP pads every shard to the same size)."""
    out = []
    for it in states:
        div = divisors[it.name]
        if zero >= _ZERO_SHARDED.get(it.category, 4):
            div *= group
        out.append(_local_item(it, div))
    return out


def apply_offload(states, offload: tuple[str, ...]) -> tuple[list[MemoryItem], int]:
    """(states kept on the device, bytes moved to host): ``optimizer`` moves optimizer states and
    master weights (DeepSpeed ZeRO-Offload, FSDP's CPUOffloadPolicy), ``params`` the parameters."""
    moved = set()
    if "optimizer" in offload:
        moved |= {Category.OPTIMIZER_STATE, Category.PAGED_STATE, Category.MASTER_WEIGHT}
    if "params" in offload:
        moved.add(Category.PARAMETER)
    kept = [it for it in states if it.category not in moved]
    return kept, sum(it.bytes for it in states if it.category in moved)
