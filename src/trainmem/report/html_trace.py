"""The HTML page of a trace (schema ``trainmem.trace``): the timeline, what is alive at the peak, modules.

:func:`timeline_svg` is the one timeline chart of a trace: this page (a trace's JSON rendered by
``report/html.py``) and ``trace --html`` (``report/trace_page.py``, from a TraceResult) both draw it."""

from __future__ import annotations

import json

from typing import Sequence

from trainmem.report.html_base import _Page, _e, _pct, _shape, stacked_bars, table
from trainmem.report.units import downsample, fmt_bytes

__all__ = ["timeline_svg", "PHASE_COLORS"]

PHASE_COLORS = {"forward": "#e8f1fb", "backward": "#fdf0e6", "optimizer": "#eaf7ea", "step_in_backward": "#eaf7ea",
                "other": "#f4f4f4"}


def timeline_svg(xs: Sequence[int], allocated: Sequence[int], reserved: Sequence[int],
                 phases: Sequence[tuple[int, str]], *, width: int = 960, height: int = 320) -> str:
    """Allocated and reserved bytes per allocation event (``xs``: each point's event index), the
    ``phases`` ``(first event, name)`` as shaded bands, labelled over a band where the name fits and
    all named in a key below, the y axis labelled inside the svg, the allocated peak marked. At most
    ``width`` points are drawn (each bucket's maximum, so the peak stays)."""
    pad, left = 50, 80  # room for the y-axis labels ("123.45 GiB" at 10 px) inside the svg
    pick = downsample(allocated, width)
    end = (xs[-1] + 1) if xs else 1
    top = max(max(reserved, default=0), max(allocated, default=0), 1)

    def x(i: float) -> float:
        return left + (width - left - pad) * (i / max(end - 1, 1))

    def y(v: float) -> float:
        return height - pad - (v / top) * (height - 2 * pad)

    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" role="img">']
    marks = list(phases) + [(end, "")]
    for (start, phase), (stop, _) in zip(marks, marks[1:]):
        if stop > start:
            out.append(f'<rect x="{x(start):.1f}" y="{pad}" width="{max(x(stop) - x(start), 0.5):.1f}" '
                       f'height="{height - 2 * pad}" fill="{PHASE_COLORS.get(phase, "#fff")}">'
                       f'<title>{_e(phase)}</title></rect>')
            if x(stop) - x(start) >= 8 * len(phase):  # a label only where it fits over its band
                out.append(f'<text class="phase" x="{(x(start) + x(stop)) / 2:.1f}" y="{pad - 6}" font-size="11" '
                           f'text-anchor="middle" fill="#555">{_e(phase)}</text>')
    for series, color, name in ((reserved, "#888", "reserved (allocator model)"), (allocated, "#1f5fbf", "allocated")):
        if series:
            pts = " ".join(f"{x(xs[i]):.1f},{y(series[i]):.1f}" for i in pick)
            out.append(f'<polyline fill="none" stroke="{color}" stroke-width="1.5" points="{pts}">'
                       f'<title>{name}</title></polyline>')
    if allocated:
        k = max(range(len(allocated)), key=allocated.__getitem__)
        out.append(f'<circle cx="{x(xs[k]):.1f}" cy="{y(allocated[k]):.1f}" r="4" fill="#c00">'
                   f'<title>peak {_e(fmt_bytes(allocated[k]))}</title></circle>')
    for k in range(5):
        v = top * k / 4
        out.append(f'<text class="ylabel" x="{left - 6}" y="{y(v) + 4:.1f}" font-size="10" text-anchor="end">'
                   f'{fmt_bytes(int(v))}</text>')  # binary units that suit the size
    kx = left  # a key of the phases, every band named even where its own label does not fit
    for phase in dict.fromkeys(p for _, p in phases):
        out.append(f'<rect x="{kx}" y="{height - 38}" width="10" height="10" fill="{PHASE_COLORS.get(phase, "#fff")}" '
                   f'stroke="#bbb"/><text class="phase-key" x="{kx + 14}" y="{height - 29}" font-size="11">'
                   f'{_e(phase)}</text>')
        kx += 14 + 7 * len(phase) + 16
    out.append(f'<text x="{width / 2}" y="{height - 12}" font-size="11" text-anchor="middle">'
               f'allocation events (blue: allocated, grey: reserved; bands: phases)</text></svg>')
    return "".join(out)


def _trace(d: dict, page: _Page) -> None:
    meta, inputs = d.get("meta", {}), d.get("inputs") or {}
    step = inputs.get("step") or {}
    model = (inputs.get("model") or {}).get("name") or meta.get("model_class", "model")
    page.subtitle = (f"{model} · B={step.get('batch', '?')} "
                     f"S={step.get('seq', '?')} · {step.get('precision', '?')} · "
                     f"{'fake' if meta.get('fake', True) else 'real'} tensors")
    page.card("peak allocated", fmt_bytes(d.get("peak_bytes", 0)), peak=True)
    page.card("peak at", f"{d.get('peak_phase')} / {d.get('peak_module') or '<root>'} / {d.get('peak_op')}")
    page.card("reserved peak (allocator model)", fmt_bytes(d.get("peak_reserved_bytes", 0)))
    page.card("fragmentation at peak", f"{d.get('fragmentation', 0):.1%}")
    page.card("allocations", f"{d.get('num_allocations', 0):,}")
    tl = d.get("timeline")
    if tl and tl.get("allocated_bytes"):
        page.section("Timeline", timeline_svg(tl["index"], tl["allocated_bytes"], tl.get("reserved_bytes", []),
                                              [tuple(p) for p in tl.get("phases", [])]))
    totals = {k: v for k, v in d.get("totals_at_peak_bytes", {}).items() if v}
    if totals:
        whole = sum(totals.values())
        page.section("Alive at the peak, by category",
                     stacked_bars([("at peak", totals)], height=220) +
                     table(["category", "size", "share"], [[k, fmt_bytes(v), _pct(v, whole)] for k, v in totals.items()],
                           numeric=(1, 2)))
    top = d.get("top_at_peak", [])
    if top:
        page.section("Largest tensors at the peak", table(
            ["name", "category", "size", "op", "phase", "shape", "dtype"],
            [[t["name"], t["category"], fmt_bytes(t["bytes"]), t.get("op", ""), t.get("phase", ""),
              _shape(t.get("shape")), t.get("dtype", "")] for t in top], numeric=(2,)))
    mods = sorted(d.get("modules", []), key=lambda m: -max(m["forward_peak_bytes"], m["backward_peak_bytes"]))[:40]
    if mods:
        page.section("Modules: highest allocated bytes while running", table(
            ["module", "forward peak", "backward peak"],
            [[m["name"] or "<root>", fmt_bytes(m["forward_peak_bytes"]), fmt_bytes(m["backward_peak_bytes"])]
             for m in mods], numeric=(1, 2)))
    if d.get("items"):
        page.items = d["items"]
    shown = {**{k: v for k, v in inputs.items() if v is not None and k != "model"}, **meta}
    if shown:
        page.section("Step", f"<pre>{_e(json.dumps(shown, indent=1, default=str))}</pre>")

