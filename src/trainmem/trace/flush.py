"""The three-state fit verdict (:data:`trainmem.fits.FIT_STATES`) of a trace, from its own recording.

A trace's reserved figure is its recorded allocation stream replayed through the caching-allocator
model (:mod:`trainmem.trace.allocator`, ``TraceResult.peak_reserved_bytes``): the reserved peak of
an unlimited device. Where that is over the usable memory, the same stream is replayed at the usable
memory with the allocator's release-and-retry (c10/cuda/CUDACachingAllocator.cpp
``DeviceCachingAllocator::malloc``: a failed cudaMalloc calls ``release_cached_blocks`` and
``alloc_block`` again; :func:`trainmem.estimate.allocation_order.replay_events_with_flush`): if no
cudaMalloc then fails, the step runs only by flushing the cache (``fits_with_cache_flush``).

Known limitations:
  - With ``expandable_segments`` the capped replay is not modelled (segments grow and shrink in
    place): two answers, as for a measurement.
  - A trace loaded without its recording (``TraceResult.recording`` None) has no stream to replay:
    two answers.
"""

from __future__ import annotations

from trainmem.trace import recording as R

__all__ = ["trace_events", "trace_fit_state", "UNREPLAYED"]

#: Why a trace's verdict has two answers, by cause (said in the output).
UNREPLAYED = {"expandable": "the capped replay is not modelled with expandable_segments",
              "recording": "the trace's recording was not kept"}


def trace_events(rec: R.Recording) -> list[tuple]:
    """The recording as ``("alloc", block id, nbytes)`` / ``("free", block id)``, as
    ``trace.result.analyze`` replays it for ``peak_reserved_bytes``."""
    blocks = rec.blocks
    return [("alloc", e, blocks[e].nbytes) if e >= 0 else ("free", ~e) for e in rec.events]


def trace_fit_state(result, usable_bytes: int, *, expandable_segments: bool = False):
    """``(fit_state, FlushReplay | None, why_unreplayed)`` of a :class:`~trainmem.trace.result.TraceResult`
    against ``usable_bytes`` of reserved memory. The flush replay runs only where it decides the
    answer: the unlimited reserved peak over usable and the allocated peak not; ``why_unreplayed``
    is a key of :data:`UNREPLAYED` where it would decide but cannot run, else ``""``."""
    from trainmem.estimate.allocation_order import replay_events_with_flush
    from trainmem.fits import fit_state

    reserved = result.peak_reserved_expandable_bytes if expandable_segments else result.peak_reserved_bytes
    flush, why = None, ""
    if reserved > usable_bytes >= result.peak_bytes:
        if expandable_segments:
            why = "expandable"
        elif result.recording is None:
            why = "recording"
        else:
            flush = replay_events_with_flush(trace_events(result.recording), usable_bytes)
    state = fit_state(reserved_bytes=reserved, usable_bytes=usable_bytes,
                      fits_after_flush=None if flush is None else flush.fits)
    return state, flush, why
