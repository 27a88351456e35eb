"""The HTML page of a comparison (schema ``trainmem.compare``): estimate against trace, per module."""

from __future__ import annotations

from trainmem.report.html_base import _Page, _generic_value, _layout, stacked_bars, table
from trainmem.report.units import fmt_bytes


def _compare(d: dict, page: _Page) -> None:
    peak, acts = d.get("peak", {}), d.get("activations", {})
    inputs = d.get("inputs") or {}
    s = inputs.get("step") or {}
    page.subtitle = " · ".join(str(x) for x in ((inputs.get("model") or {}).get("name"),
                                                 s.get("batch") and f"B={s['batch']} S={s.get('seq')}", s.get("precision"),
                                                 "estimate against trace, joined by module", _layout(inputs)) if x)
    for label, side in (("peak", peak), ("activations", acts)):
        if side:
            ratio = side.get("ratio")
            page.card(f"{label}: estimate / trace", f"{fmt_bytes(side.get('estimate_bytes', 0))} / "
                      f"{fmt_bytes(side.get('trace_bytes', 0))}" + (f" ({ratio - 1:+.1%})" if ratio else ""),
                      peak=label == "peak")
    if peak or acts:
        bars = [(side, {"activations": acts.get(f"{side}_bytes", 0),
                        "rest of the peak": max(peak.get(f"{side}_bytes", 0) - acts.get(f"{side}_bytes", 0), 0)})
                for side in ("estimate", "trace")]
        page.section("Estimate and trace", stacked_bars(bars, height=240))
    rows = d.get("rows", [])
    if rows:
        worst = max(range(len(rows)), key=lambda i: abs((rows[i].get("ratio") or 0) - 1))
        page.section("Saved activations per module", table(
            ["module", "estimate", "trace", "estimate / trace", "missing in"],
            [[r.get("name"), fmt_bytes(r.get("estimate_bytes", 0)), fmt_bytes(r.get("trace_bytes", 0)),
              f"{r['ratio']:.3f}" if r.get("ratio") else "—", r.get("missing_in") or ""] for r in rows],
            numeric=(1, 2, 3), highlight=worst))
    rest = {k: v for k, v in d.items() if k not in ("schema", "rows", "peak", "activations")}
    if rest:
        page.section("Details", _generic_value(rest))
