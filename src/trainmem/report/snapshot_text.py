"""Plain-text rendering of a snapshot summary (``trainmem snapshot FILE``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from trainmem.report.units import fmt_bytes

if TYPE_CHECKING:  # report never imports the tracer back (tests/test_import_cycles.py)
    from trainmem.trace.snapshot_load import SnapshotSummary

__all__ = ["render_snapshot"]


def render_snapshot(path: str, s: SnapshotSummary) -> str:
    """A SnapshotSummary as sizes a person reads (the JSON keeps the integers)."""
    peak = (f"peak allocated   {fmt_bytes(s.peak_bytes)} (replaying {s.num_events:,} trace events)"
            if s.num_events else "peak allocated   n/a (no device trace in the snapshot)")
    lines = [f"snapshot {path}",
             f"reserved         {fmt_bytes(s.reserved_bytes)} in {s.num_segments:,} segment(s)",
             f"allocated        {fmt_bytes(s.allocated_bytes)} live when the snapshot was taken", peak]
    if s.top_allocations:
        lines += ["", f"largest {len(s.top_allocations)} allocations"
                  + (" in the trace:" if s.num_events else " live at the snapshot:")]
        lines += [f"  {fmt_bytes(a.size_bytes):>12}  {a.where or '?'}" for a in s.top_allocations]
    return "\n".join(lines)
