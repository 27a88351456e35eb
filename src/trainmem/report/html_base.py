"""What every HTML renderer shares: escaping, colours, the SVG charts, the page and its tables.

The per-kind renderers (``html_estimate``, ``html_trace``, ``html_compare``, ``html_sweep``,
``html_plan``) each fill a :class:`_Page` from a result's ``to_dict()``; :mod:`trainmem.report.html`
picks one by the schema's kind and lays the page out. Nothing here runs the estimator or the tracer.
"""

from __future__ import annotations

import html
import json
from typing import Any, Sequence

from trainmem.report.units import fmt_bytes

MAX_ITEMS = 5000  # tensor rows embedded in the page
KINDS = ("estimate", "trace", "compare", "sweep", "plan")  # the schemas with their own renderer


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
    return kind if kind in KINDS else "result"


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
