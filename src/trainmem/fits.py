"""Does a step fit on a GPU? One usable-memory model and one verdict for every command that prints
a peak (estimate, trace, compare, sweep, profile), and the four figures a peak can be stated in.

The model, per rank::

    capacity = context + reserved + headroom
    reserved = allocated + allocator reserve

* ``context``: memory beyond the step's tensors, itemized (:mod:`trainmem.device_context`,
  :func:`context_items`): the CUDA context (kernel images, library handles) stated per GPU preset
  (``cuda_context_bytes``, sourced in the preset file), cuBLAS's workspaces by architecture
  (``CublasHandlePool.cpp``; from the caching allocator, but not in trainmem's step figures), plus
  NCCL's buffers when more than one rank runs (:data:`NCCL_BYTES`).
* ``allocator reserve``: bytes the caching allocator holds beyond its allocated blocks. A trace
  knows it (``reserved − allocated`` from :mod:`trainmem.trace.allocator`'s replay), a CUDA
  profile measures it; a training estimate replays its own tensors in allocation order through the
  same allocator model (:mod:`trainmem.estimate.allocation_order`, used by ``fitargs.estimate_fit``);
  ``sweep``'s estimate back-end, ``plan``'s shortlist and ``advise`` use the same replay; where no
  order is modelled (an inference estimate) it is a stated share of the capacity
  (:data:`ESTIMATE_RESERVE_FRACTION`, 5%).

The headroom is the same whatever the figure; the figure only says which number the verdict
quotes as the need, and the usable memory is the capacity less what that figure leaves out.

Figures (``--memory-figure``):

* ``allocated``: ``torch.cuda.max_memory_allocated()``, blocks the allocator handed out.
* ``active``: torchtune's "peak memory active", ``torch.cuda.memory_stats()["active_bytes.all.peak"]``
  (torchtune/training/memory.py ``get_memory_stats``): allocated blocks plus freed ones still in
  use by another stream. The estimator and the one-stream trace have no such blocks: there it
  equals allocated.
* ``reserved``: ``torch.cuda.max_memory_reserved()``.
* ``device``: what nvidia-smi shows, reserved plus context, plus bitsandbytes' paged optimizer
  state that is resident on the device. Paged states live in CUDA unified memory outside the
  caching allocator (bitsandbytes/functional.py ``get_paged``: ``cget_managed_ptr``, i.e.
  ``cudaMallocManaged``): the driver keeps their pages on the device while there is room and
  evicts them to host under pressure, so they never make a step OOM. The resident part is taken as
  ``min(paged, headroom)``: all of it when it fits beside the step, none when the step fills the GPU.

Known limitations:
  - ``cuda_context_bytes`` and :data:`NCCL_BYTES` are estimates from the sources cited, not measured
    by trainmem; ``trainmem profile`` on a GPU measures the context (``context_bytes``). The
    cuBLAS workspaces follow PyTorch's defaults (a formula per architecture, not measured here).
  - The 5% share is not a model of the allocator; the trace's and the training estimate's reserved
    figures are. Their reserved peak is an unlimited device's; near capacity the real allocator
    frees its cached segments and retries, which :data:`FIT_STATES` states as
    ``fits_with_cache_flush`` where an allocation stream is replayed at the usable memory (a training
    estimate's allocation order, a trace's recording: :mod:`trainmem.trace.flush`) or a CUDA
    measurement counted retries (:func:`measured_fit_state`); not for an inference estimate, a CPU
    profile, or a measurement over the usable memory.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

from trainmem.device_context import NCCL_BYTES, context_items
from trainmem.errors import SpecError

if TYPE_CHECKING:
    from trainmem.plan.hardware import GPU

__all__ = ["FIGURES", "FIT_STATES", "Verdict", "verdict", "fit_state", "measured_fit_state", "usable_bytes", "budget_bytes", "context_bytes", "check_figure",
           "ESTIMATE_RESERVE_FRACTION", "NCCL_BYTES", "paged_resident", "reserved_budget", "context_items"]

FIGURES = ("allocated", "active", "reserved", "device")

#: The answer to "does it fit", ``fit_state`` in every result that decides fit (estimate/trace/compare/
#: sweep/profile ``--gpu``, plan, advise, explain, serve):
#:
#: * ``fits``: the reserved peak of an unlimited device (the allocator model's replay) ≤ usable;
#: * ``fits_with_cache_flush``: it is over usable, but the step's allocations fit when the caching
#:   allocator, on a failed cudaMalloc, gives its wholly free cached segments back and retries
#:   (c10/cuda/CUDACachingAllocator.cpp ``DeviceCachingAllocator::malloc`` → ``release_cached_blocks``
#:   → ``alloc_block`` again; :func:`trainmem.estimate.allocation_order.replay_events_with_flush` over
#:   the estimate's allocation order or the trace's recording; measured: :func:`measured_fit_state`). It runs,
#:   slower: each flush synchronizes the device and cudaFree/cudaMalloc are synchronizing calls, on
#:   every step that hits the limit (``memory_stats()["num_alloc_retries"]`` counts them);
#: * ``does_not_fit``: even with the flush a cudaMalloc fails (or the allocated peak is over usable).
#:
#: ``fits`` (the boolean beside it) stays true only for ``fits``: plan and advise rank configurations
#: that fit without the flush, and list the others with this state; the largest-value searches (sweep,
#: serve, ``largest_micro_batch``) report both bounds (``measure.sweeps.bisect_max_runs``).
FIT_STATES = ("fits", "fits_with_cache_flush", "does_not_fit")

#: The estimate's allocator reserve, as a share of capacity, where no allocation order is modelled
#: (inference estimates; ``trainmem.plan.hardware.Reserve.fraction``'s default where an allocated
#: peak is compared). plan, advise, sweep, serve and the integrations compare the modelled reserved
#: peak instead (``estimate_reserved``), with ``fraction`` an extra margin, 0 by default.
ESTIMATE_RESERVE_FRACTION = 0.05

def usable_bytes(capacity_bytes: int, fixed_bytes: int, fraction: float) -> int:
    """Capacity less a fixed part and a share of the capacity (``Reserve``'s arithmetic)."""
    return capacity_bytes - fixed_bytes - int(fraction * capacity_bytes)


def context_bytes(gpu: GPU, gpus: int = 1) -> int:
    """Memory beyond the step's tensors: the preset's context (CUDA context and cuBLAS workspaces), and
    NCCL's buffers on more than one rank; the sum of :func:`context_items`."""
    return sum(i.bytes for i in context_items(gpu, gpus))


def budget_bytes(gpu: GPU, *, reserve_modelled: bool, gpus: int = 1,
                 fraction: float = ESTIMATE_RESERVE_FRACTION) -> int:
    """The largest peak that fits one rank: reserved bytes where the allocator is modelled or measured
    (capacity − context), else allocated bytes (capacity − context − ``fraction`` of capacity)."""
    return usable_bytes(gpu.memory_bytes, context_bytes(gpu, gpus), 0.0 if reserve_modelled else fraction)


def reserved_budget(gpu: GPU, *, gpus: int = 1, fixed_bytes: int | None = None, extra_fraction: float = 0.0) -> int:
    """The largest reserved peak one rank holds: capacity − context (the preset's, or ``fixed_bytes``
    given with ``--reserve``) − NCCL's buffers on more than one rank − ``extra_fraction`` of capacity
    (``--reserve-fraction``, an explicit margin, 0 by default). With the defaults it is the usable
    memory of :func:`verdict`'s ``reserved`` figure, so ``plan``/``advise``/``sweep`` and
    ``estimate --memory-figure reserved`` agree."""
    fixed = gpu.context_bytes if fixed_bytes is None else fixed_bytes
    return usable_bytes(gpu.memory_bytes, fixed + (NCCL_BYTES if gpus > 1 else 0), extra_fraction)


def fit_state(*, reserved_bytes: int, usable_bytes: int, fits_after_flush: bool | None = None) -> str:
    """One of :data:`FIT_STATES`: ``fits`` when ``reserved_bytes`` (the unlimited device's reserved
    peak) ≤ ``usable_bytes``; else ``fits_with_cache_flush`` when the replay with the allocator's
    release-and-retry at ``usable_bytes`` succeeded (``fits_after_flush``), else ``does_not_fit``.
    ``fits_after_flush`` None: no allocation order to replay (a measured or inference peak)."""
    if reserved_bytes <= usable_bytes:
        return "fits"
    return "fits_with_cache_flush" if fits_after_flush else "does_not_fit"


def measured_fit_state(*, reserved_bytes: int, usable_bytes: int, alloc_retries: int | None,
                       ooms: int | None = None) -> str:
    """:data:`FIT_STATES` of a measured step (``trainmem profile`` on CUDA): its measured reserved peak
    already includes any cache flushes the real allocator made, which ``torch.cuda.memory_stats()``
    counts in ``num_alloc_retries`` (c10/cuda/CUDACachingAllocator.cpp ``DeviceCachingAllocator::malloc``
    → ``release_cached_blocks`` → ``alloc_block`` again; ``num_ooms`` when that failed too). Within
    ``usable_bytes`` with retries and no OOM: ``fits_with_cache_flush``; over it: ``does_not_fit`` (a
    measured stream is not replayed at another capacity, so whether a flush would save it is not known)."""
    if ooms or reserved_bytes > usable_bytes:
        return "does_not_fit"
    return "fits_with_cache_flush" if alloc_retries else "fits"


def check_figure(figure: str) -> str:
    if figure not in FIGURES:
        raise SpecError("memory_figure", figure, f"must be one of {', '.join(FIGURES)}")
    return figure


@dataclass(frozen=True, kw_only=True)
class Verdict:
    """Whether one rank's step fits on ``gpu``, stated in ``figure``."""

    figure: str
    need_bytes: int
    """The peak in ``figure``."""
    usable_bytes: int
    """Capacity less what ``figure`` leaves out (context, NCCL, allocator reserve)."""
    headroom_bytes: int
    """``usable − need``: capacity − context − reserved, the same for every figure, except that the
    ``device`` figure also takes off the resident paged optimizer state."""
    fits: bool
    gpu: str
    gpus: int
    capacity_bytes: int
    context_bytes: int
    """Context plus NCCL buffers."""
    allocated_bytes: int
    reserved_bytes: int
    reserve_bytes: int
    """Allocator reserve: ``reserved − allocated``."""
    why: str
    """Where the allocator reserve comes from."""
    reserve_modelled: bool
    """Whether the reserve comes from the allocator model or a measurement (else a share)."""
    paged_bytes: int = 0
    """bitsandbytes' paged optimizer state (CUDA unified memory, outside the allocator)."""
    paged_resident_bytes: int = 0
    """The part of it counted on the device in the ``device`` figure: ``min(paged, headroom)``."""
    fit_state: str = ""
    """One of :data:`FIT_STATES` (set by :func:`verdict`); ``fits`` is true only for ``fits``."""
    flushes: int = 0
    """``fits_with_cache_flush``: failed cudaMallocs per step that release cached segments."""
    flushed_bytes: int = 0
    """``fits_with_cache_flush``: cached segments given back per step by those releases."""
    flush_reserved_bytes: int = 0
    """``fits_with_cache_flush``: the reserved peak with the releases (≤ usable)."""
    context_items: tuple = ()
    """``context_bytes`` item by item (:func:`context_items`: name, bytes, formula, source)."""

    def to_dict(self) -> dict:
        return asdict(self)


def verdict(gpu: GPU, *, allocated_bytes: int, reserved_bytes: int | None = None, active_bytes: int | None = None,
            reserved_source: str = "", figure: str = "allocated", gpus: int = 1,
            fraction: float = ESTIMATE_RESERVE_FRACTION, unmodelled: str = "not modelled for estimates",
            paged_bytes: int = 0, flush=None, state: str | None = None) -> Verdict:
    """The verdict for one rank's peak. ``reserved_bytes`` from a trace or a measurement (named in
    ``reserved_source``); without it the reserve is ``fraction`` of the capacity (``unmodelled``
    says why). ``paged_bytes`` (unified memory) never changes whether the step fits; the ``device``
    figure counts the part of it that stays resident (:func:`paged_resident`). ``flush``: the
    :class:`~trainmem.estimate.allocation_order.FlushReplay` at this verdict's usable reserved memory
    (capacity − context), where the reserved peak is over it; it decides ``fits_with_cache_flush``.
    ``state``: a state decided elsewhere (a measurement, :func:`measured_fit_state`), used as given."""
    check_figure(figure)
    capacity = gpu.memory_bytes
    context = context_bytes(gpu, gpus)
    if reserved_bytes is None:
        reserve = int(fraction * capacity)
        reserved_bytes = allocated_bytes + reserve
        why = f"allocator reserve {fraction:.0%} of capacity (fragmentation, {unmodelled})"
        modelled = False
    else:
        modelled = True
        reserve = reserved_bytes - allocated_bytes
        why = f"allocator reserve {reserved_source or 'given'}"
    headroom = capacity - context - reserved_bytes
    resident = paged_resident(paged_bytes, headroom)
    need = {"allocated": allocated_bytes, "active": allocated_bytes if active_bytes is None else active_bytes,
            "reserved": reserved_bytes, "device": reserved_bytes + context + resident}[figure]
    if figure == "device":  # the resident pages use the room they sit in: the headroom stays capacity − need
        headroom -= resident
    if state is None:
        state = fit_state(reserved_bytes=reserved_bytes, usable_bytes=capacity - context,
                          fits_after_flush=None if flush is None else flush.fits)
    elif state not in FIT_STATES:
        raise SpecError("fit_state", state, f"must be one of {', '.join(FIT_STATES)}")
    flushed = flush is not None and state == "fits_with_cache_flush"
    return Verdict(figure=figure, need_bytes=need, usable_bytes=need + headroom, headroom_bytes=headroom,
                   fits=headroom >= 0 and state == "fits", fit_state=state, flushes=flush.flushes if flushed else 0,
                   flushed_bytes=flush.flushed_bytes if flushed else 0,
                   flush_reserved_bytes=flush.reserved_bytes if flushed else 0, gpu=gpu.name, gpus=gpus, capacity_bytes=capacity, context_bytes=context,
                   allocated_bytes=allocated_bytes, reserved_bytes=reserved_bytes, reserve_bytes=reserve, why=why,
                   reserve_modelled=modelled, paged_bytes=paged_bytes, paged_resident_bytes=resident,
                   context_items=tuple(i.to_dict() for i in context_items(gpu, gpus)))


def paged_resident(paged_bytes: int, headroom_bytes: int) -> int:
    """How much of a paged (unified-memory) optimizer state nvidia-smi counts on the device: the
    driver migrates its pages to the GPU when the optimizer touches them (bitsandbytes
    ``prefetch_tensor`` / ``cprefetch``) and evicts them only when device memory runs out, so the
    resident part is what fits in the room the step leaves."""
    if paged_bytes < 0:
        raise SpecError("paged_bytes", paged_bytes, "must be >= 0")
    return max(0, min(paged_bytes, headroom_bytes))
