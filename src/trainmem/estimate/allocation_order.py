"""Reserved memory for an estimate: the estimate's tensors allocated and freed in the order a
training step makes them, replayed through the caching-allocator model the trace uses
(:mod:`trainmem.trace.allocator`).

The estimator has per-tensor items and phases, not an allocation order; fragmentation comes from
the order. This module writes one, per tensor, in the order eager PyTorch runs a steady-state step
(optimizer state exists, ``zero_grad(set_to_none=True)`` freed the gradients):

1. **before the step** (the trace's baseline): parameters, master weights, optimizer states, in
   parameter order (``torch.optim.Adam._init_group`` creates ``exp_avg`` then ``exp_avg_sq`` per
   parameter); gradients too under gradient accumulation.
2. **forward**: each saved activation in forward order, embedding, then block 0, 1, ..., then the
   head's and the loss's (``torch.autograd`` keeps what the forward saved until its backward node
   runs); then the logits (and their upcast copy) the output holds (the ``forward`` phase's
   ``logits`` part).
3. **loss backward**: the log-softmax's and the logits' gradients (``logits_grad``), the logits
   freed, then the head's saved tensors freed and its weight gradients allocated
   (``torch/csrc/autograd/engine.cpp`` frees a node's saved variables after it runs,
   ``AccumulateGrad`` allocates ``.grad`` on first accumulation), the gradient of the hidden state
   (one residual-sized tensor) allocated.
4. **backward of block L-1, ..., 0**: the block's recomputed activations (under checkpointing),
   the new residual gradient and the gradient of the block's largest saved tensor (the ``backward``
   phase's working set), the block's weight gradients in reverse, its saved activations freed in
   reverse, then the working set.
5. **after the blocks**: the embedding's gradient, the remaining activations freed.
6. **optimizer step**: the temporaries (``optimizer_temporaries``), one per gradient and in
   proportion to it (foreach's per-tensor lists, ``torch/optim/adam.py _multi_tensor_adam``), freed.

Parts of a phase this order does not place per tensor (FSDP all-gathers, DDP buckets, offload
windows, a dequantized 4-bit weight) are one block each, allocated where the phase starts and
freed after the phase that last holds them.

The reserve is ``reserved peak − logical peak`` of this stream (block rounding, segment rounding
and fragmentation); the estimate's reserved figure is its own allocated peak plus that reserve,
so the allocated peak stays the estimator's.

Known limitations:
  - Forward and backward temporaries that are not saved (an op's intermediate outputs, autograd's
    per-op gradient buffers beyond the working set above) are not in the stream, so a segment the
    real step cuts for them and later reuses is missing: the trace's reserve is usually larger
    (tests/estimate/test_estimate_reserved.py states the measured ratios).
  - One stream, except FSDP2's side-stream pools (:mod:`trainmem.estimate.fsdp_streams`, in the
    unlimited and the capacity flush replay alike); no ``empty_cache``; no ``expandable_segments`` unless asked; the per-rank
    inventories under parallelism are replayed as one device's.
  - The reserved peak is that of an unlimited device, and it is not monotone in the sequence
    length (docs/plan.md "What fits means": freed activation segments smaller than the optimizer's
    weight-sized temporaries stay cached while B·S < hidden). At a real capacity the allocator
    gives wholly free cached segments back and retries: :func:`replay_with_flush` replays that, and
    :func:`estimate_fit_state` turns it into the verdicts' third answer, ``fits_with_cache_flush``
    (:data:`trainmem.fits.FIT_STATES`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from trainmem.inventory import Category, MemoryItem
from trainmem.names import is_head, layer_of

__all__ = ["ReservedModel", "FlushReplay", "allocation_events", "estimate_reserved", "fits_with_release",
           "replay_with_flush", "replay_events_with_flush", "estimate_fit_state", "SOURCE"]

#: Named in every output that uses the model.
SOURCE = "from the estimate's allocation order replayed through the caching-allocator model"

_STATIC = (Category.PARAMETER, Category.MASTER_WEIGHT, Category.OPTIMIZER_STATE)
#: Phase parts this order places per tensor; any other part is one block (see the module docstring).
_PLACED = {"parameters", "master_weights", "optimizer_states", "gradients", "activations", "logits",
           "logits_grad", "recompute_and_work", "work", "optimizer_temporaries",
           "node_work",  # a node's moment inside a block (estimate/block_backward.py): the phase bounds it, not placed
           "recomputed",  # the same moment's recomputed block set (placed in step 4 from recompute_and_work)
           "new_gradients"}  # and, under gradient accumulation, the block's new gradients beside their .grad


@dataclass(frozen=True)
class ReservedModel:
    reserved_bytes: int
    """The estimate's reserved peak: its allocated peak plus :attr:`reserve_bytes`."""
    reserve_bytes: int
    """Reserved peak of the replay less the logical peak of the same stream."""
    stream_peak_bytes: int
    """Logical peak of the stream (the estimate's phases bound it)."""
    replay_reserved_bytes: int
    events: int
    source: str = SOURCE


def _order(items: list[MemoryItem]) -> tuple[list[MemoryItem], dict[int, list[MemoryItem]], list[MemoryItem]]:
    """Activations split into (before the blocks, per block in order, head and loss)."""
    pre, blocks, head = [], {}, []
    for it in items:
        li = layer_of(it.name)
        if li is not None:
            blocks.setdefault(li, []).append(it)
        elif is_head(it.name):
            head.append(it)
        else:
            pre.append(it)
    return pre, dict(sorted(blocks.items())), head


def allocation_events(est) -> list[tuple]:
    """``("alloc", key, nbytes)`` / ``("free", key)`` for one steady-state step of ``est``
    (an :class:`~trainmem.estimate.Estimate`), in the order of the module docstring."""
    items = list(est.inventory)
    phases = {p.name: p for p in est.phases}
    ev: list[tuple] = []
    live: set = set()

    def alloc(key, n: int) -> None:
        if n > 0 and key not in live:
            live.add(key)
            ev.append(("alloc", key, int(n)))

    def free(key) -> None:
        if key in live:
            live.discard(key)
            ev.append(("free", key))

    grads = [it for it in items if it.category is Category.GRADIENT]
    accum = est.step.grad_accum > 1
    for it in items:
        if it.category in _STATIC or (accum and it.category is Category.GRADIENT):
            alloc(it.name, it.bytes)
    # parts placed as one block each: allocated when the first phase holding them starts
    names = [p.name for p in est.phases]
    extra: dict[str, tuple[int, str]] = {}  # part -> (largest bytes, last phase holding it)
    for p in est.phases:
        for k, v in p.parts.items():
            if k not in _PLACED and v > 0:
                extra[k] = (max(v, extra.get(k, (0, ""))[0]), p.name)
    first = {k: next(p.name for p in est.phases if p.parts.get(k, 0) > 0) for k in extra}

    def phase_start(name: str) -> None:
        for k, (n, _) in extra.items():
            if first[k] == name:
                alloc(("part", k), n)

    def phase_end(name: str) -> None:
        for k, (_, last) in extra.items():
            if last == name:
                free(("part", k))

    acts = [it for it in items if it.category is Category.ACTIVATION]
    pre, blocks, head = _order(acts)
    phase_start("forward")
    loss = [it for it in head if it.name.startswith("loss.")]
    head = [it for it in head if not it.name.startswith("loss.")]
    for it in pre + [it for b in blocks.values() for it in b] + head:
        alloc(it.name, it.bytes)
    # the head's output, its upcast copy for the loss, then what the loss saves; the output object
    # is dropped when forward returns (only .loss is kept)
    fwd = phases.get("forward")
    held = fwd.parts.get("logits", 0) if fwd else 0
    low = min(held, _logits_bytes(est))
    alloc("logits", low)
    alloc("logits_upcast", held - low)
    for it in loss:
        alloc(it.name, it.bytes)
    free("logits_upcast")
    free("logits")
    phase_end("forward")
    by_layer: dict[int | None, list[MemoryItem]] = {}
    for g in grads:
        by_layer.setdefault(layer_of(g.name), []).append(g)
    outside = by_layer.pop(None, [])
    head_grads = [g for g in outside if is_head(g.name)]
    late = [g for g in outside if not is_head(g.name)]
    phase_start("backward_start")
    # nll_loss backward makes the log-softmax output's gradient, log_softmax backward the logits'
    # (loss dtype), the upcast's backward casts it to the logits' dtype; each input freed after use
    lg = phases["backward_start"].parts.get("logits_grad", 0) if "backward_start" in phases else 0
    # NllLossBackward0 releases its saved target and total weight before log_softmax's backward
    # runs (torch/csrc/autograd/engine.cpp: release_variables after call_function; estimate/peak.py)
    for it in loss:
        if it.name in ("loss.target", "loss.total_weight"):
            free(it.name)
    alloc("logits_grad.0", lg // 2)
    alloc("logits_grad.1", lg - lg // 2)
    free("logits_grad.0")
    for it in reversed(loss):
        free(it.name)
    alloc("logits_grad.low", low if held > low else 0)
    if held > low:
        free("logits_grad.1")
    phase_end("backward_start")
    resid = _residual(est)
    for g in head_grads:
        alloc(g.name, g.bytes)
    alloc(("dx", "head"), resid)
    for it in reversed(head):
        free(it.name)
    free("logits_grad.1")
    free("logits_grad.low")
    prev = ("dx", "head")
    bwd = phases.get("backward")
    rec = _recompute(bwd, resid, blocks)
    phase_start("backward")
    for li in sorted(set(blocks) | set(by_layer), reverse=True):  # a checkpointed block may keep nothing
        saved = blocks.get(li, [])
        alloc(("recompute", li), rec)
        dx = ("dx", li)
        alloc(dx, resid)
        alloc(("dlargest", li), max((it.bytes for it in saved), default=0))
        for g in reversed(by_layer.get(li, [])):
            alloc(g.name, g.bytes)
        for it in reversed(saved):
            free(it.name)
        free(("dlargest", li))
        free(("recompute", li))
        free(prev)
        prev = dx
    phase_end("backward")
    phase_end("backward_first_block")
    phase_start("backward_end")
    for g in late:
        alloc(g.name, g.bytes)
    for it in reversed(pre):
        free(it.name)
    free(prev)
    phase_end("backward_end")
    opt = phases.get("optimizer")
    if opt is not None:
        phase_start("optimizer")
        _optimizer(est, opt.parts.get("optimizer_temporaries", 0), grads, items, alloc, free)
        phase_end("optimizer")
    return ev


def _optimizer(est, tb: int, grads: list[MemoryItem], items: list[MemoryItem], alloc, free) -> None:
    """``optimizer.step()``: a master-weight recipe's fp32 gradient copies (one per master, the
    16-bit gradient freed as each is made: trace/step.py's order), then the step's temporaries by
    implementation (:mod:`trainmem.estimate.optimizer_step`): foreach holds one per stepped tensor
    at once, in proportion to it; the for-loop two like the tensor, one tensor at a time (the square
    root and the quotient of ``_single_tensor_adam``); fused none."""
    masters = [it for it in items if it.category is Category.MASTER_WEIGHT]
    copies = sum(m.bytes for m in masters)
    if copies and tb >= copies:
        for m, g in zip(masters, grads):
            alloc(("master_grad", m.name), m.bytes)
            free(g.name)
        tb -= copies
        grads = [replace(g, bytes=m.bytes) for m, g in zip(masters, grads)]
    if not tb or not grads:
        return
    if est.optimizer_impl == "for-loop":
        for g in grads:
            n = g.bytes
            alloc(("sqrt", g.name), n)
            alloc(("quotient", g.name), n)
            free(("sqrt", g.name))
            free(("quotient", g.name))
        return
    total = sum(g.bytes for g in grads)
    for g in grads:
        alloc(("tmp", g.name), g.bytes * tb // total)
    for g in grads:
        free(("tmp", g.name))


def _logits_bytes(est) -> int:
    """B·S·V in the logits' dtype (the head's matmul output), as the estimate counts it."""
    from trainmem.estimate.heads import logits_width
    from trainmem.inventory import dtype_bytes
    d = est.step.dtypes
    return int(est.step.batch * est.step.seq * logits_width(est.model)
               * dtype_bytes(d.activation if d.autocast else d.compute))


def _residual(est) -> int:
    from trainmem.inventory import dtype_bytes
    step = est.step
    return int(step.batch * step.seq * est.model.hidden_size * dtype_bytes(step.dtypes.compute))


def _recompute(bwd, resid: int, blocks: dict[int, list[MemoryItem]]) -> int:
    """Bytes a checkpointed block re-materializes: the ``backward`` phase's working set less the
    residual gradient and the largest saved tensor's gradient (0 without recompute)."""
    if bwd is None or not blocks:
        return 0
    last = blocks[max(blocks)]
    return max(0, bwd.parts.get("recompute_and_work", 0) - resid - max((it.bytes for it in last), default=0))


def estimate_reserved(est, *, expandable_segments: bool = False) -> ReservedModel:
    """The estimate's reserved peak from its allocation order (see the module docstring). Cached per
    estimate object, so the verdict and the figure line share one replay."""
    key = (id(est), expandable_segments)
    hit = _CACHE.get(key)
    if hit is None or hit[0] is not est:
        if len(_CACHE) >= 8:
            _CACHE.pop(next(iter(_CACHE)))
        hit = _CACHE[key] = (est, _replay(est, expandable_segments))
    return hit[1]


_CACHE: dict[tuple[int, bool], tuple[object, ReservedModel]] = {}


@dataclass(frozen=True)
class FlushReplay:
    """The estimate's stream replayed at a capacity with the allocator's release-and-retry:
    c10/cuda/CUDACachingAllocator.cpp ``DeviceCachingAllocator::malloc``, when ``alloc_block``'s
    cudaMalloc fails, calls ``release_cached_blocks`` (``synchronize_and_free_events`` then a
    cudaFree of every cached segment that is not split) and tries ``alloc_block`` again; the real
    allocator counts each such retry in ``memory_stats()["num_alloc_retries"]``."""

    usable_bytes: int
    """The reserved bytes the verdict allows (capacity − context − NCCL − margin)."""
    fits: bool
    """No cudaMalloc failed after the release: the step runs within ``usable_bytes``."""
    flushes: int
    """Failed cudaMallocs that released cached segments (``num_alloc_retries`` in one step)."""
    flushed_bytes: int
    """Cached segments given back (cudaFree) by those releases."""
    reserved_bytes: int
    """The reserved peak with the releases (``max_memory_reserved`` on that device), on the same
    footing as :attr:`ReservedModel.reserved_bytes`: the estimate's allocated peak plus the replay's
    reserve."""


def replay_with_flush(est, usable_bytes: int) -> FlushReplay:
    """:class:`FlushReplay` of ``est`` on a device that holds ``usable_bytes`` of reserved memory.
    The stream's logical peak can differ from the estimate's allocated peak (parts placed as one
    block, module docstring); the stream gets the capacity less that difference, so the replay's
    limit and :func:`estimate_reserved`'s figure are on one footing (a stream whose unlimited
    reserved figure is within ``usable_bytes`` never releases)."""
    from trainmem.estimate.fsdp_streams import pooled_events

    model = estimate_reserved(est)  # the same pooled events (FSDP2's side-stream pools) as _replay
    return replay_events_with_flush(pooled_events(est, allocation_events(est)), usable_bytes,
                                    shift_bytes=est.peak_bytes - model.stream_peak_bytes)


def replay_events_with_flush(events, usable_bytes: int, *, shift_bytes: int = 0) -> FlushReplay:
    """Replay ``("alloc", key, nbytes[, stream])`` / ``("free", key)`` events through the
    caching-allocator model capped at ``usable_bytes − shift_bytes`` of reserved memory, with the
    release-and-retry (:class:`FlushReplay`; the release frees wholly free segments of every stream's
    pools, as ``release_cached_blocks`` does). ``shift_bytes``: what the reserved figure the verdict compares adds to
    the stream's own (0 for a trace, whose reserved figure is this stream's replay); the returned
    ``reserved_bytes`` adds it back. Pure: no torch, no I/O."""
    from trainmem.trace.allocator import CachingAllocator

    alloc = CachingAllocator(capacity_bytes=usable_bytes - shift_bytes)
    flushes = top = 0
    for e in events:
        if e[0] == "free":
            alloc.free(e[1])
            continue
        before = alloc.released_bytes
        alloc.malloc(e[1], e[2], stream=e[3] if len(e) > 3 else 0)
        flushes += alloc.released_bytes > before
        if alloc.out_of_memory:
            break
        top = max(top, alloc.reserved_bytes)
    return FlushReplay(usable_bytes=usable_bytes, fits=not alloc.out_of_memory, flushes=flushes,
                       flushed_bytes=alloc.released_bytes, reserved_bytes=top + shift_bytes)


def fits_with_release(est, capacity_bytes: int) -> bool:
    """Whether the stream fits ``capacity_bytes`` of reserved memory when, as on a failed cudaMalloc
    (``DeviceCachingAllocator::malloc`` → ``release_cached_blocks``), wholly free cached segments are
    given back before a new one is made (:func:`replay_with_flush`)."""
    return replay_with_flush(est, capacity_bytes).fits


def estimate_fit_state(est, usable_bytes: int) -> tuple[str, FlushReplay | None]:
    """The three-state verdict (:func:`trainmem.fits.fit_state`) of ``est`` against ``usable_bytes``
    of reserved memory, and the flush replay where one ran: only when the unlimited reserved peak is
    over ``usable_bytes`` and the allocated peak is not (else the answer is known without it)."""
    from trainmem.fits import fit_state

    reserved = estimate_reserved(est).reserved_bytes
    flush = None
    if reserved > usable_bytes >= est.peak_bytes:
        flush = replay_with_flush(est, usable_bytes)
    return fit_state(reserved_bytes=reserved, usable_bytes=usable_bytes,
                     fits_after_flush=None if flush is None else flush.fits), flush


def _replay(est, expandable_segments: bool) -> ReservedModel:
    # FSDP2's side streams keep their own pools (estimate/fsdp_streams.py); other estimates: one pool
    from trainmem.estimate.fsdp_streams import pooled_events, replay_pools

    ev = pooled_events(est, allocation_events(est))
    reserved, top = replay_pools(ev, expandable_segments=expandable_segments)
    reserve = max(0, reserved - top)
    return ReservedModel(reserved_bytes=est.peak_bytes + reserve, reserve_bytes=reserve, stream_peak_bytes=top,
                         replay_reserved_bytes=reserved, events=len(ev))
