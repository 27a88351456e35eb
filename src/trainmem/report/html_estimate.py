"""The HTML page of an estimate (schema ``trainmem.estimate``): ledgers, phases, per-block bars, tensors."""

from __future__ import annotations

import json
import math

from trainmem.names import layer_of
from trainmem.report.html_base import _e, _layout, _Page, _pct, _ranks, stacked_bars, table
from trainmem.report.units import fmt_bytes


def _estimate(d: dict, page: _Page) -> None:
    inputs = d.get("inputs", {})
    m, s, im = inputs.get("model", {}), inputs.get("step", {}), inputs.get("impl", {})
    page.subtitle = (f"{m.get('name', 'model')} · L={m.get('num_layers')} H={m.get('hidden_size')} · "
                     f"B={s.get('batch')} S={s.get('seq')} · {s.get('precision')} · {s.get('optimizer')} · "
                     f"attention {im.get('attention')} · recompute {im.get('recompute')} · profile {d.get('profile')} · "
                     f"{_layout(inputs)}")
    totals = d.get("totals_bytes", {})
    phases = d.get("phases", [])
    page.card(f"peak ({d.get('peak_phase')})", fmt_bytes(d.get("peak_bytes", 0)), peak=True)
    page.card("sum of ledgers (not the peak)", fmt_bytes(sum(totals.values())))
    states = sum(v for k, v in totals.items() if k != "activation")
    page.card("model states", fmt_bytes(states))
    page.card("activations saved", fmt_bytes(totals.get("activation", 0)))
    if s.get("batch") and s.get("seq"):
        page.card("tokens per micro-batch", f"{s['batch'] * s['seq']:,}")
    whole = sum(totals.values())
    page.section("Ledgers", table(["ledger", "bytes", "size", "share"],
                                  [[k, f"{v:,}", fmt_bytes(v), _pct(v, whole)] for k, v in totals.items()],
                                  numeric=(1, 2, 3)))
    if phases:
        peak_i = max(range(len(phases)), key=lambda i: phases[i]["bytes"])
        chart = stacked_bars([(p["name"], p.get("parts", {})) for p in phases], mark=phases[peak_i]["name"])
        rows = [[p["name"], fmt_bytes(p["bytes"]), p.get("note", "")] for p in phases]
        page.section("Phases: live bytes at each point of the step",
                     chart + table(["phase", "live", "what is alive"], rows, numeric=(1,), highlight=peak_i))
    items = d.get("items")
    if items:
        per_block: dict[int, dict[str, int]] = {}
        for it in items:
            li = layer_of(it["name"])
            if li is not None:
                row = per_block.setdefault(li, {})
                row[it["category"]] = row.get(it["category"], 0) + it["bytes"]
        if per_block:
            page.section("Per block", stacked_bars([(str(li), per_block[li]) for li in sorted(per_block)],
                                                   label_every=max(1, math.ceil(len(per_block) / 16))))
        page.items = items
    _ranks(d.get("ranks"), page)
    page.section("Inputs", f"<pre>{_e(json.dumps(inputs, indent=1, default=str))}</pre>")
