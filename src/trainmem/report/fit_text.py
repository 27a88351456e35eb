"""Plain-text lines of a fit verdict (``--gpu``) and of a peak named by its figure (``--memory-figure``),
for every command that prints a peak; :mod:`trainmem.fitargs` parses the flags and picks the line."""

from __future__ import annotations

from typing import TYPE_CHECKING

from trainmem.report.units import fmt_bytes

if TYPE_CHECKING:  # renderers take results; they never compute them
    from trainmem.fits import Verdict

__all__ = ["render_verdict", "render_figure"]


def render_verdict(v: Verdict, *, label: str = "") -> str:
    """``FITS on 1× H100-80GB: needs ... allocated (≈ ... reserved), usable ..., headroom ...`` and the
    usable memory's parts."""
    head = f"{label}{'FITS' if v.fits else 'DOES NOT FIT'} on {v.gpus}× {v.gpu}"
    need = f"needs {fmt_bytes(v.need_bytes)} {v.figure}"
    if v.figure in ("allocated", "active"):
        need += f" ({'' if v.reserve_modelled else '≈ '}{fmt_bytes(v.reserved_bytes)} reserved)"
    room = f"headroom {fmt_bytes(v.headroom_bytes)}" if v.fits else f"short by {fmt_bytes(-v.headroom_bytes)}"
    parts = [f"{fmt_bytes(v.capacity_bytes)} capacity", f"{fmt_bytes(v.context_bytes)} CUDA context"
             + (" and NCCL" if v.gpus > 1 else "") + " (an estimate: the GPU preset's)"]
    if v.figure in ("allocated", "active"):  # what the figure leaves out of reserved
        parts.append(f"{fmt_bytes(v.capacity_bytes - v.context_bytes - v.usable_bytes)} {v.why}")
    usable = " − ".join(parts) if v.figure != "device" else f"{fmt_bytes(v.capacity_bytes)} capacity"
    out = f"{head}: {need}, usable {fmt_bytes(v.usable_bytes)}, {room}\n  usable = {usable}"
    if v.figure in ("reserved", "device"):  # say where the reserve in the need comes from
        out += f"\n  reserved = {fmt_bytes(v.allocated_bytes)} allocated + {fmt_bytes(v.reserve_bytes)} {v.why}"
    if v.paged_bytes:
        out += (f"\n  paged optimizer state {fmt_bytes(v.paged_bytes)} (CUDA unified memory, outside the allocator: "
                f"never the cause of an OOM), {fmt_bytes(v.paged_resident_bytes)} of it resident on the device"
                + (" and counted in the device figure" if v.figure == "device" else ""))
    return out


def render_figure(figure: str, nbytes: int, note: str = "") -> str:
    """A peak line naming its figure, for a command run without ``--gpu``."""
    return f"peak {figure}: {fmt_bytes(nbytes)}" + (f" ({note})" if note else "")
