"""One self-contained HTML report for any trainmem result: an estimate, a trace, a comparison, a
sweep or a plan. Inline CSS, inline SVG charts and a few lines of inline script; nothing is
fetched, so the file works offline and can be attached to a bug report.

Every renderer takes the result's ``to_dict()`` (schemas ``trainmem.estimate/2``,
``trainmem.trace/2``, ``trainmem.compare/2``, ``trainmem.sweep/2``, ``trainmem.plan/2``), so it
does not depend on the classes; a dict of an unknown schema is shown as generic tables. The
page reads without scripts; the script adds sorting and a filter to the tensor table.

Known limitations: the tensor table keeps the 5,000 largest items; SVG charts are drawn here (no
matplotlib), so they are simpler than :mod:`trainmem.report.plots`.
"""

from __future__ import annotations

import html
import json
import math
from pathlib import Path
from typing import Any, Sequence

from trainmem.atomic import write_text_atomic
from trainmem.names import layer_of
from trainmem.report.units import fmt_bytes

__all__ = ["to_html", "write_html", "html_fragment", "as_dict", "stacked_bars", "line_chart"]

MAX_ITEMS = 5000  # tensor rows embedded in the page


def _e(s: object) -> str:
    return html.escape(str(s), quote=True)
COLORS = {
    "parameter": "#4e79a7", "parameters": "#4e79a7",
    "gradient": "#f28e2b", "gradients": "#f28e2b",
    "master_weight": "#b07aa1", "master_weights": "#b07aa1",
    "optimizer_state": "#e15759", "optimizer_states": "#e15759",
    "activation": "#59a14f", "activations": "#59a14f",
    "logits": "#edc948", "logits_grad": "#b6992d",
    "transient": "#bab0ac", "input": "#9c755f", "kv_cache": "#76b7b2",
    "unattributed": "#333333", "host": "#d4a6c8",
}
_EXTRA = ("#76b7b2", "#ff9da7", "#9c755f", "#bab0ac", "#86bcb6", "#8cd17d", "#f1ce63", "#a0cbe8", "#ffbe7d",
          "#d37295", "#499894", "#79706e", "#d7b5a6", "#fabfd2", "#17becf", "#bcbd22")
FONT = 'font-family="system-ui, sans-serif"'


def color_of(name: str, i: int = 0) -> str:
    return COLORS.get(name, _EXTRA[i % len(_EXTRA)])


def palette(names: Sequence[str]) -> dict[str, str]:
    """One colour per name, no two alike within a chart: a ledger keeps its own colour (``COLORS``),
    every other name takes the next colour no name uses yet."""
    out: dict[str, str] = {}
    for name in names:
        if name in COLORS and COLORS[name] not in out.values():
            out[name] = COLORS[name]
    spare = iter([c for c in (*_EXTRA, *COLORS.values()) if c not in out.values()])
    for name in names:
        if name not in out:
            out[name] = next(spare, "#999999")
    return out


def nice_max(v: float) -> float:
    """The smallest 1/2/2.5/5 × 2^k-ish round number ≥ v, in binary units for bytes."""
    if v <= 0:
        return 1.0
    unit = 1.0
    while v / unit >= 1024:
        unit *= 1024
    x = v / unit
    step = 1.0
    while step * 10 < x:
        step *= 10
    for m in (1, 2, 2.5, 5, 10):
        if m * step >= x:
            return m * step * unit
    return 10 * step * unit


def stacked_bars(rows: Sequence[tuple[str, dict[str, int]]], *, mark: str | None = None,
                 width: int = 760, height: int = 300, title: str = "", mark_label: str = "peak",
                 mark_value: int | None = None,
                 label_every: int = 1) -> str:
    """Vertical bars, one per ``(label, {part: bytes})``, parts stacked; ``mark`` outlines one bar;
    every ``label_every``-th bar is labelled."""
    parts: list[str] = []
    for _, d in rows:
        parts += [k for k, v in d.items() if v and k not in parts]
    top = nice_max(max([sum(d.values()) for _, d in rows] + [1]))
    colors = palette(parts)
    left, right, tpad, bottom = 74, 150, 24, 46
    plot_w, plot_h = width - left - right, height - tpad - bottom
    n = max(len(rows), 1)
    slot = plot_w / n
    bw = min(slot * 0.7, 80)
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {width} {height}" width="{width}" '
           f'height="{height}" role="img" {FONT} font-size="11">']
    if title:
        out.append(f'<title>{_e(title)}</title>')
    for k in range(5):
        v = top * k / 4
        y = tpad + plot_h - plot_h * k / 4
        out.append(f'<line x1="{left}" x2="{left + plot_w}" y1="{y:.1f}" y2="{y:.1f}" stroke="#e5e5e5"/>'
                   f'<text x="{left - 6}" y="{y + 4:.1f}" text-anchor="end" fill="#555">{_e(fmt_bytes(v))}</text>')
    for i, (label, d) in enumerate(rows):
        x = left + slot * i + (slot - bw) / 2
        y = tpad + plot_h
        for j, p in enumerate(parts):
            v = d.get(p, 0)
            if not v:
                continue
            h = plot_h * v / top
            y -= h
            out.append(f'<rect x="{x:.1f}" y="{y:.1f}" width="{bw:.1f}" height="{max(h, 0.5):.1f}" '
                       f'fill="{colors[p]}"><title>{_e(label)} · {_e(p)}: {_e(fmt_bytes(v))}</title></rect>')
        total = sum(d.values())
        ty = tpad + plot_h - plot_h * total / top
        if label == mark:
            out.append(f'<rect x="{x - 2:.1f}" y="{ty - 2:.1f}" width="{bw + 4:.1f}" height="{tpad + plot_h - ty + 2:.1f}" '
                       f'fill="none" stroke="#c00" stroke-width="2"/>'
                       f'<text x="{x + bw / 2:.1f}" y="{ty - 6:.1f}" text-anchor="middle" fill="#c00" '
                       f'font-weight="bold">{_e(mark_label)} {_e(fmt_bytes(total if mark_value is None else mark_value))}</text>')
        if i % label_every:
            continue
        room = max(4, int(slot * label_every // 6.5))  # characters that fit under the bar at 11 px
        short = label if len(label) <= room else label[:room - 1] + "…"
        out.append(f'<text x="{x + bw / 2:.1f}" y="{tpad + plot_h + 16}" text-anchor="middle">{_e(short)}'
                   f'<title>{_e(label)}: {_e(fmt_bytes(total))}</title></text>')
    for j, p in enumerate(parts):
        y = tpad + 14 * j
        out.append(f'<rect x="{width - right + 12}" y="{y}" width="10" height="10" fill="{colors[p]}"/>'
                   f'<text x="{width - right + 27}" y="{y + 9}">{_e(p)}</text>')
    out.append("</svg>")
    return "".join(out)


def line_chart(series: Sequence[tuple[str, Sequence[float], Sequence[float], str, str]], *,
               bands: Sequence[tuple[float, float, str, str]] = (), marks: Sequence[tuple[float, float, str]] = (),
               xlabel: str = "", width: int = 760, height: int = 300, y_bytes: bool = True) -> str:
    """Lines ``(name, xs, ys, color, style)`` (style: ``line``, ``dash`` or ``points``), shaded x
    ``bands`` ``(x0, x1, label, color)`` and labelled ``marks`` ``(x, y, text)``."""
    xs_all = [x for _, xs, _, _, _ in series for x in xs] or [0.0, 1.0]
    ys_all = [y for _, _, ys, _, _ in series for y in ys] + [m[1] for m in marks] or [1.0]
    x0, x1 = min(xs_all), max(xs_all)
    if x1 == x0:
        x1 = x0 + 1
    top = nice_max(max(ys_all + [1])) if y_bytes else max(ys_all + [1]) * 1.1
    left, right, tpad, bottom = 74, 190, 24, 46
    plot_w, plot_h = width - left - right, height - tpad - bottom

    def X(x: float) -> float:
        return left + plot_w * (x - x0) / (x1 - x0)

    def Y(y: float) -> float:
        return tpad + plot_h - plot_h * y / top

    fmt = fmt_bytes if y_bytes else (lambda v: f"{v:g}")
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {width} {height}" width="{width}" '
           f'height="{height}" role="img" {FONT} font-size="11">']
    for a, b, label, color in bands:
        out.append(f'<rect x="{X(a):.1f}" y="{tpad}" width="{max(X(b) - X(a), 0.5):.1f}" height="{plot_h}" '
                   f'fill="{color}"><title>{_e(label)}</title></rect>'
                   f'<text x="{X(a) + 3:.1f}" y="{tpad + 11}" fill="#777">{_e(label)}</text>')
    for k in range(5):
        v = top * k / 4
        out.append(f'<line x1="{left}" x2="{left + plot_w}" y1="{Y(v):.1f}" y2="{Y(v):.1f}" stroke="#e5e5e5"/>'
                   f'<text x="{left - 6}" y="{Y(v) + 4:.1f}" text-anchor="end" fill="#555">{_e(fmt(v))}</text>')
    for k in range(5):
        v = x0 + (x1 - x0) * k / 4
        out.append(f'<text x="{X(v):.1f}" y="{tpad + plot_h + 16}" text-anchor="middle" fill="#555">{v:,.0f}</text>')
    out.append(f'<text x="{left + plot_w / 2}" y="{height - 8}" text-anchor="middle">{_e(xlabel)}</text>')
    legend = 0
    for name, xs, ys, color, style in series:
        if style == "points":
            for x, y in zip(xs, ys):
                out.append(f'<circle cx="{X(x):.1f}" cy="{Y(y):.1f}" r="3.5" fill="{color}">'
                           f'<title>{_e(name)}: {x:,.0f} → {_e(fmt(y))}</title></circle>')
        else:
            pts = " ".join(f"{X(x):.1f},{Y(y):.1f}" for x, y in zip(xs, ys))
            dash = ' stroke-dasharray="5 3"' if style == "dash" else ""
            out.append(f'<polyline fill="none" stroke="{color}" stroke-width="1.6"{dash} points="{pts}">'
                       f'<title>{_e(name)}</title></polyline>')
        if not name:  # unnamed: drawn, not in the legend
            continue
        ly = tpad + 14 * legend
        legend += 1
        out.append(f'<line x1="{width - right + 10}" x2="{width - right + 24}" y1="{ly + 5}" y2="{ly + 5}" '
                   f'stroke="{color}" stroke-width="3"/><text x="{width - right + 28}" y="{ly + 9}">{_e(name)}</text>')
    for x, y, text in marks:
        out.append(f'<circle cx="{X(x):.1f}" cy="{Y(y):.1f}" r="5" fill="#c00"><title>{_e(text)}</title></circle>'
                   f'<text x="{X(x):.1f}" y="{Y(y) - 9:.1f}" text-anchor="middle" fill="#c00" '
                   f'font-weight="bold">{_e(text)}</text>')
    out.append("</svg>")
    return "".join(out)


# ---------------------------------------------------------------------------------------------
# pages

_CSS = """
.tm { font-family: system-ui, -apple-system, "Segoe UI", sans-serif; color: #1d2330; max-width: 1120px;
      margin: 0 auto; padding: 20px 24px 40px; line-height: 1.4; }
.tm h1 { font-size: 22px; margin: 0 0 2px; } .tm h2 { font-size: 17px; margin: 28px 0 8px;
      border-bottom: 1px solid #e3e6ec; padding-bottom: 4px; }
.tm .sub { color: #5b6475; margin: 0 0 16px; font-size: 13px; }
.tm .cards { display: flex; flex-wrap: wrap; gap: 12px; }
.tm .card { border: 1px solid #e3e6ec; border-radius: 8px; padding: 10px 14px; min-width: 150px; background: #fafbfd; }
.tm .card .v { font-size: 20px; font-weight: 600; font-variant-numeric: tabular-nums; }
.tm .card .l { font-size: 12px; color: #5b6475; } .tm .card.peak { border-color: #c00; background: #fff6f6; }
.tm .card.peak .v { color: #b00; }
.tm table { border-collapse: collapse; font-size: 13px; margin: 6px 0 12px; }
.tm td, .tm th { border-bottom: 1px solid #eceff4; padding: 3px 10px 3px 0; text-align: left; vertical-align: top; }
.tm th { font-weight: 600; color: #3b4252; cursor: default; } .tm th.sort { cursor: pointer; }
.tm td.n { text-align: right; font-variant-numeric: tabular-nums; white-space: nowrap; }
.tm tr.hl td { background: #fff3cd; } .tm .muted { color: #6b7385; font-size: 12px; }
.tm input[type=search] { padding: 4px 8px; width: 320px; border: 1px solid #c9ced8; border-radius: 4px; }
.tm pre { background: #f5f6f8; padding: 8px; font-size: 12px; overflow: auto; max-height: 320px; }
.tm svg { max-width: 100%; height: auto; } .tm code { font-size: 12px; }
"""

_JS = r"""
(function () {
  var node = document.getElementById('tm-items');
  if (!node) { document.body.setAttribute('data-ready', '1'); return; }
  var data = JSON.parse(node.textContent), rows = data.rows;
  var body = document.querySelector('#tensors tbody'), info = document.getElementById('tensors-info');
  var q = document.getElementById('tensors-filter'), key = 4, dir = -1, LIMIT = 1000;
  function fmt(n) { var u = ['B', 'KiB', 'MiB', 'GiB', 'TiB'], i = 0;
    while (Math.abs(n) >= 1024 && i < 4) { n /= 1024; i++; } return i ? n.toFixed(2) + ' ' + u[i] : n + ' B'; }
  function cell(tr, text, num) { var td = document.createElement('td'); td.textContent = text;
    if (num) td.className = 'n'; tr.appendChild(td); }
  function draw() {
    var f = q.value.toLowerCase(), shown = rows.filter(function (r) {
      return !f || (r[0] + ' ' + r[1] + ' ' + r[5]).toLowerCase().indexOf(f) >= 0; });
    shown.sort(function (a, b) { var x = a[key], y = b[key];
      return (x < y ? -1 : x > y ? 1 : 0) * dir; });
    body.textContent = '';
    shown.slice(0, LIMIT).forEach(function (r) { var tr = document.createElement('tr');
      cell(tr, r[0]); cell(tr, r[1]); cell(tr, r[2]); cell(tr, r[3]); cell(tr, fmt(r[4]), true); cell(tr, r[5]);
      body.appendChild(tr); });
    info.textContent = 'showing ' + Math.min(shown.length, LIMIT) + ' of ' + shown.length + ' tensors' +
      (data.total > rows.length ? ' (the ' + rows.length + ' largest of ' + data.total + ')' : '');
  }
  q.addEventListener('input', draw);
  Array.prototype.forEach.call(document.querySelectorAll('#tensors th'), function (th, i) {
    th.className = 'sort'; th.addEventListener('click', function () {
      dir = key === i ? -dir : (i === 4 ? -1 : 1); key = i; draw(); }); });
  draw();
  document.body.setAttribute('data-ready', '1');
})();
"""


def as_dict(result: Any) -> dict:
    """A result object's ``to_dict()``, or the dict itself."""
    if isinstance(result, dict):
        return result
    to_dict = getattr(result, "to_dict", None)
    if to_dict is None:
        raise TypeError(f"cannot render a {type(result).__name__}: expected a trainmem result or its to_dict()")
    return to_dict()


def kind_of(d: dict) -> str:
    """``estimate``, ``trace``, ``compare``, ``sweep``, ``plan`` or ``result`` (unknown schema)."""
    schema = str(d.get("schema", ""))
    kind = schema.split("/")[0].removeprefix("trainmem.")
    return kind if kind in _RENDERERS else "result"


class _Page:
    """What a renderer produces: a subtitle, summary cards, sections and the tensor rows."""

    def __init__(self) -> None:
        self.subtitle = ""
        self.cards: list[tuple[str, str, bool]] = []
        self.sections: list[tuple[str, str]] = []
        self.items: list[dict] | None = None

    def card(self, label: str, value: object, peak: bool = False) -> None:
        self.cards.append((label, str(value), peak))

    def section(self, title: str, body: str) -> None:
        self.sections.append((title, body))


def table(headers: Sequence[str], rows: Sequence[Sequence[object]], *, numeric: Sequence[int] = (),
          highlight: int | None = None, id: str | None = None) -> str:
    head = "".join(f"<th>{_e(h)}</th>" for h in headers)
    body = []
    for r, row in enumerate(rows):
        cells = "".join(f'<td class="n">{_e(c)}</td>' if i in numeric else f"<td>{_e(c)}</td>"
                        for i, c in enumerate(row))
        body.append(f'<tr{" class=hl" if r == highlight else ""}>{cells}</tr>')
    ident = f' id="{_e(id)}"' if id else ""
    return f"<table{ident}><thead><tr>{head}</tr></thead><tbody>{''.join(body)}</tbody></table>"


def _pct(part: int, whole: int) -> str:
    return f"{100 * part / whole:.1f}%" if whole else "—"


def _shape(shape) -> str:
    return "×".join(map(str, shape)) if shape else "scalar"


def _layout(inputs: dict) -> str:
    """The parallel layout and the fine-tuning in words: ``tp2 dp4 zero1 · lora r=16``; ``one GPU``."""
    par, ft = inputs.get("parallel") or {}, inputs.get("finetune") or {}
    parts = [f"{k}{par[k]}" for k in ("tp", "cp", "ep", "pp", "dp") if (par.get(k) or 1) > 1]
    parts += [word for key, word in (("sp", "sp"), ("zero", f"zero{par.get('zero')}"), ("fsdp", f"fsdp {par.get('fsdp')}"),
                                     ("offload", f"offload {','.join(par.get('offload') or ())}")) if par.get(key)]
    words = " ".join(parts) or "one GPU"
    if ft.get("mode") in ("lora", "qlora"):
        words += f" · {ft['mode']} r={ft.get('lora_rank')}"
    elif ft.get("freeze"):
        words += f" · frozen {','.join(ft['freeze'])}"
    return words


# estimate -----------------------------------------------------------------------------------------

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


def _ranks(ranks: list | None, page: _Page) -> None:
    if not ranks:
        return
    rows = [(str(r.get("name", i)), dict(r.get("totals_bytes", {}))) for i, r in enumerate(ranks)]
    worst = max(ranks, key=lambda r: r.get("peak_bytes", 0))
    # the bars stack each rank's ledgers (a sum); the mark names the rank's computed peak
    chart = stacked_bars(rows, mark=str(worst.get("name")), mark_label="peak",
                         mark_value=worst.get("peak_bytes", 0))
    tab = table(["rank class", "ranks", "peak", "host"],
                [[r.get("name"), r.get("count", ""), fmt_bytes(r.get("peak_bytes", 0)), fmt_bytes(r.get("host_bytes", 0))]
                 for r in ranks], numeric=(1, 2, 3))
    page.section("Per rank", chart + tab)


# trace -------------------------------------------------------------------------------------------

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


# sweep -------------------------------------------------------------------------------------------

def fit_quadratic(xs: Sequence[float], ys: Sequence[float]) -> tuple[float, float, float]:
    """Least-squares ``y ≈ a + b·x + c·x²`` (a line when fewer than three points)."""
    n = len(xs)
    if n == 0:
        return 0.0, 0.0, 0.0
    if n < 3:
        if n == 1 or xs[0] == xs[-1]:
            return float(ys[0]), 0.0, 0.0
        b = (ys[-1] - ys[0]) / (xs[-1] - xs[0])
        return ys[0] - b * xs[0], b, 0.0
    scale = max(abs(x) for x in xs) or 1.0
    u = [x / scale for x in xs]
    m = [[sum(ui ** (i + j) for ui in u) for j in range(3)] for i in range(3)]
    r = [sum(y * ui ** i for ui, y in zip(u, ys)) for i in range(3)]
    for col in range(3):  # Gaussian elimination with partial pivoting
        piv = max(range(col, 3), key=lambda i: abs(m[i][col]))
        m[col], m[piv], r[col], r[piv] = m[piv], m[col], r[piv], r[col]
        if abs(m[col][col]) < 1e-12:
            return fit_quadratic(xs[:2], ys[:2]) if n < 3 else (sum(ys) / n, 0.0, 0.0)
        for i in range(col + 1, 3):
            f = m[i][col] / m[col][col]
            m[i] = [a - f * b for a, b in zip(m[i], m[col])]
            r[i] -= f * r[col]
    coef = [0.0, 0.0, 0.0]
    for i in (2, 1, 0):
        coef[i] = (r[i] - sum(m[i][j] * coef[j] for j in range(i + 1, 3))) / m[i][i]
    return coef[0], coef[1] / scale, coef[2] / scale**2


def _curve(fit: dict | None, xs: Sequence[float], ys: Sequence[float]) -> tuple[float, float, float]:
    """``(constant, linear, quadratic)`` coefficients: the sweep's own fit, else a least-squares one."""
    if fit and fit.get("constant") is not None and fit.get("linear_coef") is not None:
        return fit["constant"], fit["linear_coef"], fit.get("quadratic_coef") or 0.0
    return fit_quadratic(xs, ys)


def _sweep(d: dict, page: _Page) -> None:
    over = d.get("over", "value")
    points = sorted((p for p in d.get("points", []) if p.get("peak_bytes") is not None), key=lambda p: p["value"])
    model = ((d.get("inputs") or {}).get("model") or {}).get("name")
    page.subtitle = " · ".join(str(x) for x in (model, f"memory against {over}",
                                                 d.get("backend") and f"backend {d['backend']}",
                                                 _layout(d.get("inputs") or {})) if x)
    if d.get("max_fit") is not None:
        page.card(f"largest {over} that fits", f"{d['max_fit']:,}", peak=True)
    if d.get("budget_bytes"):
        page.card("budget", fmt_bytes(d["budget_bytes"]))
    if d.get("verdict"):
        page.card("activation growth", d["verdict"])
    if d.get("crossover_seq"):
        page.card("attention overtakes the linear terms at seq", f"{d['crossover_seq']:,.0f}")
    fits = d.get("fit") or {}
    if points:
        xs = [p["value"] for p in points]
        grid = sorted({xs[0] + (xs[-1] - xs[0]) * k / 60 for k in range(61)} | set(xs))  # the points are vertices
        series = []
        ledgers = [k for k in dict.fromkeys(k for p in points for k, v in p.get("totals_bytes", {}).items() if v)]
        colors = palette(ledgers)
        for j, (name, ys, fit) in enumerate(
                [("peak", [p["peak_bytes"] for p in points], fits.get("peak"))] +
                [(k, [p.get("totals_bytes", {}).get(k, 0) for p in points], fits.get("ledgers", {}).get(k))
                 for k in ledgers]):
            color = "#111" if name == "peak" else colors[name]  # black: no ledger's colour
            exp = f" ~{over}^{fit['exponent']:.2f}" if fit and fit.get("exponent") is not None else ""
            series.append((f"{name}{exp}", xs, ys, color, "points"))
            a, b, c = _curve(fit, xs, ys)
            curve = [a + b * x + c * x * x for x in grid]
            if name == "peak" or not _through(curve, grid, xs, ys):
                # the peak is the largest phase, a maximum of polynomials, not one: joined point to point,
                # as is a ledger its quadratic does not pass through
                series.append(("", xs, ys, color, "line"))
            else:
                series.append(("", grid, curve, color, "dash"))
        if d.get("budget_bytes"):
            series.append(("budget", [xs[0], xs[-1]], [d["budget_bytes"]] * 2, "#c00", "line"))
        page.section(f"Memory against {over} (points and fitted curves)", line_chart(series, xlabel=over, height=340))
        page.section("Points", table(
            [over, "peak", *ledgers, "fits"],
            [[f"{p['value']:,}", fmt_bytes(p["peak_bytes"]),
              *(fmt_bytes(p.get("totals_bytes", {}).get(k, 0)) for k in ledgers),
              {True: "yes", False: "no"}.get(p.get("fits"), "")] for p in points],
            numeric=tuple(range(len(ledgers) + 2))))
    if fits:
        rows = [("peak", fits["peak"])] if isinstance(fits.get("peak"), dict) else []
        for group in ("ledgers", "terms"):
            rows += [(f"{group[:-1]} {k}", v) for k, v in (fits.get(group) or {}).items() if isinstance(v, dict)]
        page.section("Fitted growth: y ≈ constant + linear·x + quadratic·x², and the log-log exponent", table(
            ["", "exponent", "constant", "linear", "quadratic", "points"],
            [[name, "—" if f.get("exponent") is None else f"{f['exponent']:.3f}", _num(f.get("constant")),
              _num(f.get("linear_coef")), _num(f.get("quadratic_coef")), f.get("num_points", "")] for name, f in rows],
            numeric=(1, 2, 3, 4, 5)))


def _through(curve: Sequence[float], grid: Sequence[float], xs: Sequence[float], ys: Sequence[float]) -> bool:
    """Whether the fitted curve passes within 0.5% of the largest value through every point."""
    at = dict(zip(grid, curve))
    tol = 0.005 * max(max(ys), 1)
    return all(abs(at[x] - y) <= tol for x, y in zip(xs, ys))


def _num(x: object) -> str:
    return "—" if x is None else f"{x:.4g}" if isinstance(x, float) else str(x)


# plan --------------------------------------------------------------------------------------------

def _config_text(c: object) -> str:
    if isinstance(c, dict):
        return " ".join(f"{k}={v}" for k, v in c.items()
                        if v not in (None, False, 1, "none", (), []) or k in ("batch", "micro_batch"))
    return str(c)


def _plan(d: dict, page: _Page) -> None:
    cands = d.get("candidates", [])
    fits = [c for c in cands if c.get("fits")]
    inp = d.get("inputs", {})
    gpu = inp.get("gpu", {})
    gpu = gpu.get("name", "") if isinstance(gpu, dict) else gpu
    batch = inp.get("global_batch") and f"global batch {inp['global_batch']} sequences" + (
        f" ({inp['global_batch_note']})" if inp.get("global_batch_note") else "")
    seq = (inp.get("step") or {}).get("seq")
    page.subtitle = " · ".join(str(x) for x in ((inp.get("model") or {}).get("name"), seq and f"S={seq}", batch,
                                                 gpu and f"{inp.get('gpus', '?')} × {gpu}") if x)
    # the same counts, in the same words, as the text report (trainmem.plan.render.screen_line)
    st = d.get("search", {})
    if "evaluated" in st:
        page.card("configurations screened", f"{st['evaluated']:,}")
        page.card("fit by the closed-form screen", f"{st.get('fitting', 0):,}")
    if "checked" in st:
        page.card("checked with the per-rank estimate", f"{st['checked']:,}")
    page.card("shown that fit", f"{len(fits):,} of {len(cands):,}")
    found = next((c for c in d.get("gpu_counts", []) if c.get("fits")), None)
    if found:
        page.card("smallest GPU count that fits", f"{found['gpus']:,}", peak=True)
    best = max(fits, key=lambda c: c.get("tokens_per_s") or 0, default=None)
    if best:
        page.card("best tokens/s", f"{best.get('tokens_per_s', 0):,.0f}", peak=True)
        page.card("its peak per rank", fmt_bytes(best.get("peak_bytes", 0)))
    usable = d.get("reserve", {}).get("usable_bytes")
    if usable:
        page.card("usable per rank", fmt_bytes(usable))
    if not cands:
        return

    def pts(cs: list[dict]) -> tuple[list, list]:
        cs = [c for c in cs if c.get("tokens_per_s") is not None]
        return [c["tokens_per_s"] for c in cs], [c.get("peak_bytes", 0) for c in cs]

    series = []
    if len(fits) < len(cands):
        series.append(("does not fit", *pts([c for c in cands if not c.get("fits")]), "#b8bcc6", "points"))
    if fits:
        series.append(("fits", *pts(fits), "#2a7f3f", "points"))
    pareto = [p for p in d.get("pareto", []) if isinstance(p, dict)]
    if pareto:
        series.append(("Pareto front", *pts(sorted(pareto, key=lambda c: c.get("tokens_per_s") or 0)), "#c00", "line"))
    if usable:
        xs = [c["tokens_per_s"] for c in cands + pareto if c.get("tokens_per_s") is not None] or [0]
        series.append(("usable memory", [min(xs), max(xs)], [usable, usable], "#222", "dash"))
    page.section("Peak per rank against throughput", line_chart(series, xlabel="tokens/s"))
    ranked = sorted(cands, key=lambda c: (not c.get("fits"), -(c.get("tokens_per_s") or 0)))[:50]
    page.section("Best configurations", table(
        ["config", "peak per rank", "step time (s)", "tokens/s", "fits"],
        [[_config_text(c.get("config")), fmt_bytes(c.get("peak_bytes", 0)), f"{c.get('step_time_s') or 0:.3f}",
          f"{c.get('tokens_per_s') or 0:,.0f}", "yes" if c.get("fits") else "no"] for c in ranked],
        numeric=(1, 2, 3), highlight=0 if best else None))
    if d.get("rejected"):
        page.section("Rejected", table(["config", "why"], [[_config_text(r.get("config")), r.get("reason", "")]
                                                          for r in d["rejected"][:200]]))
    _ranks((best or {}).get("ranks"), page)


# compare and anything else --------------------------------------------------------------------------

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


def _generic(d: dict, page: _Page) -> None:
    page.subtitle = str(d.get("schema", "result"))
    if "peak_bytes" in d:
        page.card("peak", fmt_bytes(d["peak_bytes"]), peak=True)
    page.section("Result", _generic_value({k: v for k, v in d.items() if k != "schema"}))


def _generic_value(v: Any, depth: int = 0) -> str:
    """Scalars as a two-column table, lists of dicts as tables, nested dicts recursively."""
    if depth > 6:
        return f"<pre>{_e(json.dumps(v, default=str)[:2000])}</pre>"
    if isinstance(v, dict):
        scal = [[k, _scalar(k, x)] for k, x in v.items() if not isinstance(x, (dict, list))]
        out = [table(["", ""], scal, numeric=(1,))] if scal else []
        for k, x in v.items():
            if isinstance(x, (dict, list)) and x:
                out.append(f"<h3>{_e(k)}</h3>{_generic_value(x, depth + 1)}")
        return "".join(out)
    if isinstance(v, list) and v and all(isinstance(x, dict) for x in v):
        keys = list(dict.fromkeys(k for x in v[:500] for k in x))
        return table(keys, [[_scalar(k, x.get(k, "")) if not isinstance(x.get(k), (dict, list))
                             else json.dumps(x.get(k), default=str)[:200] for k in keys] for x in v[:500]])
    return f"<pre>{_e(json.dumps(v, indent=1, default=str)[:20000])}</pre>"


def _scalar(key: str, x: object) -> str:
    if key.endswith("_bytes") and isinstance(x, (int, float)) and not isinstance(x, bool):
        return fmt_bytes(x)
    return "" if x is None else str(x)


_RENDERERS = {"estimate": _estimate, "trace": _trace, "compare": _compare, "sweep": _sweep, "plan": _plan}


# assembly ----------------------------------------------------------------------------------------

def _build(d: dict) -> _Page:
    page = _Page()
    _RENDERERS.get(kind_of(d), _generic)(d, page)
    return page


def _body(page: _Page, title: str, *, script: bool) -> str:
    cards = "".join(f'<div class="card{" peak" if p else ""}"><div class="v">{_e(v)}</div><div class="l">{_e(l)}</div></div>'
                    for l, v, p in page.cards)
    parts = [f'<h1>{_e(title)}</h1><p class="sub">{_e(page.subtitle)}</p><div class="cards" id="summary">{cards}</div>']
    for t, body in page.sections:
        parts.append(f"<h2>{_e(t)}</h2>{body}")
    if page.items:
        items = sorted(page.items, key=lambda i: -i.get("bytes", 0))
        rows = [[i["name"], i.get("category", ""), _shape(i.get("shape")), i.get("dtype", ""), i.get("bytes", 0),
                 i.get("formula", "")] for i in items[:MAX_ITEMS]]
        static = [[r[0], r[1], r[2], r[3], fmt_bytes(r[4]), r[5]] for r in rows[:50]]
        parts.append("<h2>Tensors</h2>")
        if script:
            parts.append('<p><input type="search" id="tensors-filter" placeholder="filter by name, ledger or formula">'
                         ' <span class="muted" id="tensors-info">the 50 largest tensors</span></p>')
        parts.append(table(["name", "ledger", "shape", "dtype", "size", "formula"], static, numeric=(4,), id="tensors"))
        if script:
            blob = json.dumps({"rows": rows, "total": len(items)}, separators=(",", ":")).replace("<", "\\u003c")
            parts.append(f'<script type="application/json" id="tm-items">{blob}</script>')
    return "".join(parts)


def html_fragment(result: Any, *, title: str | None = None) -> str:
    """The report as a ``<div>`` with scoped styles and no script (for notebooks)."""
    d = as_dict(result)
    page = _build(d)
    return f'<div class="tm"><style>{_CSS}</style>{_body(page, title or _title(d), script=False)}</div>'


def _title(d: dict) -> str:
    return f"trainmem {kind_of(d)}"


def to_html(result: Any, *, title: str | None = None) -> str:
    """The whole page as a string: ``result`` is a trainmem result object or its ``to_dict()``."""
    d = as_dict(result)
    page = _build(d)
    title = title or _title(d)
    return (f'<!doctype html>\n<html lang="en"><head><meta charset="utf-8">'
            f'<meta name="viewport" content="width=device-width, initial-scale=1">'
            f'<title>{_e(title)}</title><style>body {{ margin: 0; background: #fff; }}{_CSS}</style></head>'
            f'<body><main class="tm">{_body(page, title, script=True)}</main>'
            f'<script>{_JS}</script></body></html>\n')


def write_html(result: Any, path: str | Path, *, title: str | None = None) -> Path:
    """Write :func:`to_html` to ``path`` whole or not at all (a temporary file, then a rename)."""
    write_text_atomic(path, to_html(result, title=title))
    return Path(path)
