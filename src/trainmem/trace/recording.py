"""What a trace records: one :class:`Block` per storage lifetime and the allocation/free event list.

The recorder (``trace/_recorder.py``) writes a :class:`Recording`; ``trace/result.py`` turns it into
a :class:`~trainmem.trace.result.TraceResult` (categories from each block's origin and lifetime), and
``trace/flush.py`` replays its events through the caching-allocator model.
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["CUDA_MIN_BLOCK_BYTES", "round_up", "short_op", "Block", "Recording", "ORIGIN_PARAMETER", "ORIGIN_BUFFER",
           "ORIGIN_GRADIENT", "ORIGIN_MASTER", "ORIGIN_STATE", "ORIGIN_INPUT", "ORIGIN_OP", "ORIGIN_RECOMPUTE",
           "ORIGIN_FSDP"]

CUDA_MIN_BLOCK_BYTES = 512  # c10/cuda/CUDACachingAllocator.cpp kMinBlockSize


def round_up(nbytes: int, multiple: int = CUDA_MIN_BLOCK_BYTES) -> int:
    return -(-nbytes // multiple) * multiple


def short_op(func) -> str:
    """``aten.mm.default`` -> ``mm``: an op as blocks name it."""
    try:
        return func._overloadpacket.__name__
    except AttributeError:
        return getattr(func, "__name__", str(func))


# Where a storage came from, decided while recording; the final category is decided later
# from these plus its lifetime (see result.py).
ORIGIN_PARAMETER = "parameter"
ORIGIN_BUFFER = "buffer"
ORIGIN_GRADIENT = "gradient"
ORIGIN_MASTER = "master_weight"
ORIGIN_STATE = "optimizer_state"
ORIGIN_INPUT = "input"
ORIGIN_OP = "op"
ORIGIN_RECOMPUTE = "recompute"
ORIGIN_FSDP = "fsdp_unsharded"  # FSDP2's gathered parameters, resized in place (trace/parallel_fsdp.py)


@dataclass(slots=True)
class Block:
    """One storage: its size, creator and lifetime in event indices."""

    id: int
    nbytes: int
    size: int  # nbytes rounded up to 512, what the CUDA allocator hands out
    op: str
    module: str
    phase: str
    origin: str
    shape: tuple[int, ...]
    dtype: str
    alloc_at: int
    free_at: int | None = None
    saved: bool = False  # seen by the saved-tensor pack hook
    name: str = ""  # item name for model states and inputs; ops are named ``<module>.<op>``
    stream: int = 0  # the CPU stream current at allocation (0: default; FSDP's side streams: 1, 2, ...)


@dataclass
class Recording:
    """The raw trace: blocks and the event list (``id`` allocates, ``~id`` frees)."""

    blocks: list[Block] = field(default_factory=list)
    events: list[int] = field(default_factory=list)
    marks: list[tuple[int, str]] = field(default_factory=list)  # (event index, phase) when a phase starts
    module_peaks: dict[tuple[str, str], int] = field(default_factory=dict)  # (module, phase) -> bytes
    module_order: list[str] = field(default_factory=list)
    baseline: int = 0  # number of blocks alive at entry (registered, not allocated in the window)
    # bitsandbytes' paged optimizer states (CUDA unified memory, trace/low_bit_optim.py): not in events
    paged: list[Block] = field(default_factory=list)
