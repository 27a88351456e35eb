"""Rich display in Jupyter: ``_repr_html_`` for result objects.

The fragment is the HTML report without its script (notebooks may not run it): summary cards,
inline SVG charts and tables, with styles scoped to the fragment.
"""

from __future__ import annotations

from typing import Any

from trainmem.report.html import html_fragment

__all__ = ["estimate_html", "trace_html", "result_html"]


def estimate_html(e: Any) -> str:
    """HTML for an :class:`~trainmem.estimate.Estimate` (``Estimate._repr_html_``)."""
    return html_fragment(e.to_dict(items=True), title=f"trainmem estimate: {e.model.name}")


def trace_html(t: Any) -> str:
    """HTML for a :class:`~trainmem.trace.TraceResult` (``TraceResult._repr_html_``)."""
    name = t.meta.get("model_name") or t.meta.get("model", "model")
    return html_fragment(t.to_dict(), title=f"trainmem trace: {name}")


def result_html(result: Any) -> str:
    """HTML for any trainmem result object (trace, sweep, plan, comparison) or its ``to_dict()``."""
    return html_fragment(result)
