"""A self-contained HTML page for one trace: timeline (inline SVG), totals, top tensors, modules.

No scripts or styles are fetched: the page works offline and can be attached to a bug report.
"""

from __future__ import annotations

import html
import json
from pathlib import Path
from typing import TYPE_CHECKING

from trainmem.report.units import downsample, fmt_bytes

if TYPE_CHECKING:  # report never imports the tracer back (tests/test_import_cycles.py)
    from trainmem.trace.result import TraceResult

__all__ = ["to_html", "write_html"]

WIDTH, HEIGHT, PAD = 960, 320, 50
LEFT = 80  # room for the y-axis labels ("123.45 GiB" at 10 px) inside the svg
PHASE_COLORS = {"forward": "#e8f1fb", "backward": "#fdf0e6", "optimizer": "#eaf7ea", "step_in_backward": "#eaf7ea",
                "other": "#f4f4f4"}


def _mib(n: int) -> str:
    return f"{n / 2**20:,.2f}"


def _svg(result: TraceResult) -> str:
    alloc, reserved = result.timeline_allocated_bytes, result.timeline_reserved_bytes
    n = len(alloc)
    top = max(max(reserved), max(alloc), 1)
    idx = downsample(alloc, WIDTH)

    def x(i: int) -> float:
        return LEFT + (WIDTH - LEFT - PAD) * (i / max(n - 1, 1))

    def y(v: int) -> float:
        return HEIGHT - PAD + (v / top) * -(HEIGHT - 2 * PAD)

    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{HEIGHT}" role="img">']
    marks = list(result.phases) + [(n, "")]
    for (start, phase), (end, _) in zip(marks, marks[1:]):
        if end > start:
            parts.append(f'<rect x="{x(start):.1f}" y="{PAD}" width="{max(x(end) - x(start), 0.5):.1f}" '
                         f'height="{HEIGHT - 2 * PAD}" fill="{PHASE_COLORS.get(phase, "#fff")}">'
                         f'<title>{html.escape(phase)}</title></rect>')
            if x(end) - x(start) >= 8 * len(phase):  # a label only where it fits over its band
                parts.append(f'<text class="phase" x="{(x(start) + x(end)) / 2:.1f}" y="{PAD - 6}" font-size="11" '
                             f'text-anchor="middle" fill="#555">{html.escape(phase)}</text>')
    for series, color, name in ((reserved, "#888", "reserved (allocator model)"), (alloc, "#1f5fbf", "allocated")):
        pts = " ".join(f"{x(i):.1f},{y(series[i]):.1f}" for i in idx)
        parts.append(f'<polyline fill="none" stroke="{color}" stroke-width="1.5" points="{pts}">'
                     f'<title>{name}</title></polyline>')
    peak_i = max(range(n), key=alloc.__getitem__)
    parts.append(f'<circle cx="{x(peak_i):.1f}" cy="{y(alloc[peak_i]):.1f}" r="4" fill="#c00">'
                 f'<title>peak {_mib(result.peak_bytes)} MiB</title></circle>')
    for k in range(5):
        v = top * k / 4
        parts.append(f'<text class="ylabel" x="{LEFT - 6}" y="{y(v) + 4:.1f}" font-size="10" text-anchor="end">'
                     f'{fmt_bytes(int(v))}</text>')  # binary units that suit the size
    kx = LEFT  # a key of the phases, every band named even where its own label does not fit
    for phase in dict.fromkeys(p for _, p in result.phases):
        parts.append(f'<rect x="{kx}" y="{HEIGHT - 38}" width="10" height="10" fill="{PHASE_COLORS.get(phase, "#fff")}" '
                     f'stroke="#bbb"/><text class="phase-key" x="{kx + 14}" y="{HEIGHT - 29}" font-size="11">'
                     f'{html.escape(phase)}</text>')
        kx += 14 + 7 * len(phase) + 16
    parts.append(f'<text x="{WIDTH / 2}" y="{HEIGHT - 12}" font-size="11" text-anchor="middle">'
                 f'allocation events (blue: allocated, grey: reserved; bands: phases)</text></svg>')
    return "".join(parts)


def _table(headers: list[str], rows: list[list]) -> str:
    head = "".join(f"<th>{html.escape(h)}</th>" for h in headers)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(str(c))}</td>" for c in r) + "</tr>" for r in rows)
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def to_html(result: TraceResult, *, title: str = "trainmem trace") -> str:
    """The page as a string."""
    r = result
    summary = [
        ["peak allocated (512-B rounded)", f"{_mib(r.peak_bytes)} MiB"],
        ["peak where", f"{r.peak_phase} / {r.peak_module or '<root>'} / {r.peak_op}"],
        ["reserved peak (caching allocator model)", f"{_mib(r.reserved_peak_bytes)} MiB"],
        ["reserved peak, expandable_segments", f"{_mib(r.reserved_peak_expandable_bytes)} MiB"],
        ["fragmentation at the allocated peak", f"{r.fragmentation:.1%}"],
        ["allocations", r.num_allocations],
    ]
    totals = [[k, _mib(v)] for k, v in r.totals_at_peak_bytes.items() if v]
    top = [[t.name, t.category.value, _mib(t.bytes), t.op, t.phase, "×".join(map(str, t.shape)), t.dtype]
           for t in r.top_at_peak]
    mods = sorted(r.modules, key=lambda m: -max(m.forward_peak_bytes, m.backward_peak_bytes))[:40]
    modrows = [[m.name or "<root>", _mib(m.forward_peak_bytes), _mib(m.backward_peak_bytes)] for m in mods]
    meta = html.escape(json.dumps(r.meta, indent=1, default=str))
    from trainmem.report.trace_text import _header_lines
    header = _header_lines(r.meta)  # what was traced, as the text output says it
    subtitle = " · ".join([" ".join(x.strip() for x in header if not x.startswith("precision:")).removeprefix("trace: "),
                           *(x for x in header if x.startswith("precision:"))])
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>{html.escape(title)}</title>
<style>
body {{ font-family: system-ui, sans-serif; margin: 24px; color: #222; }}
table {{ border-collapse: collapse; margin: 8px 0 24px; font-size: 13px; }}
td, th {{ border: 1px solid #ccc; padding: 3px 8px; text-align: left; }}
td:nth-child(n+2) {{ font-variant-numeric: tabular-nums; }}
pre {{ background: #f6f6f6; padding: 8px; font-size: 12px; }}
.sub {{ color: #555; margin-top: -8px; }}
</style></head><body>
<h1>{html.escape(title)}</h1>
<p class="sub">{html.escape(subtitle)}</p>
{_table(["figure", "value"], summary)}
<h2>Timeline</h2>
{_svg(r)}
<h2>Alive at the peak, by category (MiB)</h2>
{_table(["category", "MiB"], totals)}
<h2>Largest tensors at the peak</h2>
{_table(["name", "category", "MiB", "op", "phase", "shape", "dtype"], top)}
<h2>Modules: highest allocated bytes while running (MiB)</h2>
{_table(["module", "forward peak", "backward peak"], modrows)}
<h2>Step</h2>
<pre>{meta}</pre>
</body></html>
"""


def write_html(result: TraceResult, path: str | Path, *, title: str = "trainmem trace") -> Path:
    path = Path(path)
    path.write_text(to_html(result, title=title), encoding="utf-8")
    return path
