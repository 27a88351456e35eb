"""Plain-text lines of a fit verdict (``--gpu``) and of a peak named by its figure (``--memory-figure``),
for every command that prints a peak; :mod:`trainmem.fitargs` parses the flags and picks the line."""

from __future__ import annotations

from typing import TYPE_CHECKING

from trainmem.report.units import fmt_bytes

if TYPE_CHECKING:  # renderers take results; they never compute them
    from trainmem.fits import Verdict

__all__ = ["render_verdict", "render_figure", "STATE_WORDS", "flush_line"]

#: The headline of each fit state (:data:`trainmem.fits.FIT_STATES`).
STATE_WORDS = {"fits": "FITS", "fits_with_cache_flush": "FITS ONLY BY FLUSHING THE ALLOCATOR CACHE",
               "does_not_fit": "DOES NOT FIT"}


def render_verdict(v: Verdict, *, label: str = "") -> str:
    """``FITS on 1× H100-80GB: needs ... allocated (≈ ... reserved), usable ..., headroom ...`` and the
    usable memory's parts."""
    state = v.fit_state or ("fits" if v.fits else "does_not_fit")
    head = f"{label}{STATE_WORDS[state]} on {v.gpus}× {v.gpu}"
    need = f"needs {fmt_bytes(v.need_bytes)} {v.figure}"
    if v.figure in ("allocated", "active"):
        need += f" ({'' if v.reserve_modelled else '≈ '}{fmt_bytes(v.reserved_bytes)} reserved)"
    room = f"headroom {fmt_bytes(v.headroom_bytes)}" if v.headroom_bytes >= 0 else f"short by {fmt_bytes(-v.headroom_bytes)}"
    room += f" against the {'device figure' if v.figure == 'device' else 'reserved peak'}"
    blas = any(i["name"] == "blas_workspaces" for i in v.context_items)
    parts = [f"{fmt_bytes(v.capacity_bytes)} capacity", f"{fmt_bytes(v.context_bytes)} CUDA context"
             + (" and cuBLAS workspaces" if blas else "") + (" and NCCL" if v.gpus > 1 else "")
             + " (an estimate: the GPU preset's" + ("; --memory-figure device itemizes it)" if blas else ")")]
    if v.figure in ("allocated", "active"):  # what the figure leaves out of reserved
        parts.append(f"{fmt_bytes(v.capacity_bytes - v.context_bytes - v.usable_bytes)} {v.why}")
    usable = " − ".join(parts) if v.figure != "device" else f"{fmt_bytes(v.capacity_bytes)} capacity"
    out = f"{head}: {need}, usable {fmt_bytes(v.usable_bytes)}, {room}\n  usable = {usable}"
    if v.figure in ("reserved", "device"):  # say where the reserve in the need comes from
        out += f"\n  reserved = {fmt_bytes(v.allocated_bytes)} allocated + {fmt_bytes(v.reserve_bytes)} {v.why}"
    if v.figure == "device" and v.context_items:  # trainmem.device_context: each part and where it comes from
        out += f"\n  context = " + " + ".join(f"{fmt_bytes(i['bytes'])} {i['name']}" for i in v.context_items)
        out += "".join(f"\n    {i['name']}: {i['formula']}; {i['source']}" for i in v.context_items)
    if state == "fits_with_cache_flush" and v.flush_reserved_bytes:  # a replay at usable ran (not a measurement)
        out += "\n  " + flush_line(v.flushes, v.flushed_bytes, v.flush_reserved_bytes,
                                    v.capacity_bytes - v.context_bytes, v.allocated_bytes)
    if v.paged_bytes:
        out += (f"\n  paged optimizer state {fmt_bytes(v.paged_bytes)} (CUDA unified memory, outside the allocator: "
                f"never the cause of an OOM), {fmt_bytes(v.paged_resident_bytes)} of it resident on the device"
                + (" and counted in the device figure" if v.figure == "device" else ""))
    return out


def flush_line(flushes: int, flushed_bytes: int, flush_reserved_bytes: int, usable_reserved_bytes: int,
               allocated_bytes: int) -> str:
    """What ``fits_with_cache_flush`` means for one step, every margin named by its figure."""
    return (f"the reserved peak above is an unlimited device's; at {fmt_bytes(usable_reserved_bytes)} the caching "
            f"allocator's cudaMalloc fails {flushes}× per step, each time it frees its wholly free cached segments "
            f"and retries (release_cached_blocks; {fmt_bytes(flushed_bytes)} freed in all): reserved peak "
            f"{fmt_bytes(flush_reserved_bytes)} with the flushes, headroom "
            f"{fmt_bytes(usable_reserved_bytes - flush_reserved_bytes)} against it and "
            f"{fmt_bytes(usable_reserved_bytes - allocated_bytes)} against the allocated peak. It runs, slower: each "
            f"flush synchronizes the device and cudaFree/cudaMalloc stall the step (num_alloc_retries in "
            f"torch.cuda.memory_stats() counts them)")


def render_figure(figure: str, nbytes: int, note: str = "") -> str:
    """A peak line naming its figure, for a command run without ``--gpu``."""
    return f"peak {figure}: {fmt_bytes(nbytes)}" + (f" ({note})" if note else "")
