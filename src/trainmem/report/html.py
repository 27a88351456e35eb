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

import json
from pathlib import Path
from typing import Any

from trainmem.atomic import write_text_atomic
from trainmem.report.html_base import (_CSS, _JS, COLORS, KINDS, MAX_ITEMS, _e, _generic_value, _Page, _shape, as_dict,
                                       color_of, kind_of, line_chart, palette, stacked_bars, table)
from trainmem.report.html_compare import _compare
from trainmem.report.html_estimate import _estimate
from trainmem.report.html_plan import _plan
from trainmem.report.html_sweep import _sweep, fit_quadratic
from trainmem.report.html_trace import _trace
from trainmem.report.units import fmt_bytes

__all__ = ["to_html", "write_html", "html_fragment", "as_dict", "stacked_bars", "line_chart",
           "COLORS", "color_of", "palette", "kind_of", "fit_quadratic", "table"]


def _generic(d: dict, page: _Page) -> None:
    page.subtitle = str(d.get("schema", "result"))
    if "peak_bytes" in d:
        page.card("peak", fmt_bytes(d["peak_bytes"]), peak=True)
    page.section("Result", _generic_value({k: v for k, v in d.items() if k != "schema"}))


_RENDERERS = {"estimate": _estimate, "trace": _trace, "compare": _compare, "sweep": _sweep, "plan": _plan}
assert tuple(_RENDERERS) == KINDS  # kind_of names exactly the kinds registered here


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
