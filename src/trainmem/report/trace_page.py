"""A self-contained HTML page for one trace: timeline (inline SVG), totals, top tensors, modules.

No scripts or styles are fetched: the page works offline and can be attached to a bug report.
"""

from __future__ import annotations

import html
import json
from pathlib import Path
from typing import TYPE_CHECKING

from trainmem.report.html_trace import timeline_svg

if TYPE_CHECKING:  # report never imports the tracer back (tests/test_import_cycles.py)
    from trainmem.trace.result import TraceResult

__all__ = ["to_html", "write_html"]


def _mib(n: int) -> str:
    return f"{n / 2**20:,.2f}"


def _svg(result: TraceResult) -> str:
    """The trace's timeline chart, drawn by the same function as a trace JSON's page (report/html_trace.py)."""
    n = len(result.timeline_allocated_bytes)
    return timeline_svg(range(n), result.timeline_allocated_bytes, result.timeline_reserved_bytes, result.phases)


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
        ["reserved peak (caching allocator model)", f"{_mib(r.peak_reserved_bytes)} MiB"],
        ["reserved peak, expandable_segments", f"{_mib(r.peak_reserved_expandable_bytes)} MiB"],
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
