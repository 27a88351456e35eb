"""The HTML page of a trace (schema ``trainmem.trace``): the timeline, what is alive at the peak, modules."""

from __future__ import annotations

import json

from trainmem.report.html_base import _Page, _e, _pct, _shape, line_chart, stacked_bars, table
from trainmem.report.units import fmt_bytes


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
        xs, alloc, res = tl["index"], tl["allocated_bytes"], tl.get("reserved_bytes", [])
        end = xs[-1] + 1
        marks = list(tl.get("phases", [])) + [[end, ""]]
        bands = [(a, b, name, _PHASE_COLORS.get(name, "#f4f4f4")) for (a, name), (b, _) in zip(marks, marks[1:]) if b > a]
        k = max(range(len(alloc)), key=alloc.__getitem__)
        series = [("reserved (model)", xs, res, "#8a8f99", "line")] if res else []
        series.append(("allocated", xs, alloc, "#1f5fbf", "line"))
        page.section("Timeline", line_chart(series, bands=bands, xlabel="allocation events",
                                            marks=[(xs[k], alloc[k], f"peak {fmt_bytes(alloc[k])}")]))
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


_PHASE_COLORS = {"forward": "#e8f1fb", "backward": "#fdf0e6", "optimizer": "#eaf7ea", "step_in_backward": "#eaf7ea"}
