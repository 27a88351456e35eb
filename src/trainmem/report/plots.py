"""Figures with matplotlib (imported only here, only when a plot is asked for).

* :func:`plot_phases` -- the ledgers stacked in each phase of the step, the peak marked.
* :func:`plot_scaling` -- memory against sequence length or micro-batch, points and fitted
  curves, from a sweep's dict (an estimate's come from :mod:`trainmem.estimate.scaling`).
* :func:`plot_timeline` -- a traced step: allocated bytes by category (or the total when only the
  JSON is at hand), phase bands and the peak.
* :func:`plot_blocks`, :func:`plot_ranks` -- bytes per block and per rank class.
* :func:`save_plot` -- the right figure for any result, written as PNG or SVG by the extension.

Everything takes result objects or their ``to_dict()`` and computes nothing: the estimator, the
tracer and the sweeps run before. Figures are built without pyplot, so no window opens and no
global state is touched.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

from trainmem.atomic import atomic_path
from trainmem.errors import ConfigError, PlotDependencyError
from trainmem.names import layer_of
from trainmem.report.html import COLORS, as_dict, fit_quadratic, kind_of, palette
from trainmem.report.units import fmt_bytes

__all__ = ["save_plot", "figure_for", "plot_phases", "plot_blocks", "plot_ranks", "plot_scaling",
           "plot_timeline", "plot_compare", "plot_plan", "check_plot_path",
           "PlotDependencyError", "FORMATS"]

FORMATS = (".png", ".svg")
GIB = 2**30


def _figure(ncols: int = 1, nrows: int = 1, size: tuple[float, float] = (9, 4.5)):
    try:
        from matplotlib.figure import Figure
    except ModuleNotFoundError:
        raise PlotDependencyError("plots need matplotlib: pip install 'trainmem[plot]' (or pip install matplotlib)") from None
    fig = Figure(figsize=size, layout="constrained")
    axes = fig.subplots(nrows, ncols, squeeze=False)
    return fig, [ax for row in axes for ax in row]


def check_plot_path(path: str | Path) -> str:
    """The format (``png`` or ``svg``) of ``path``, or a ConfigError naming the extension."""
    suffix = Path(path).suffix.lower()
    if suffix not in FORMATS:
        raise ConfigError(f"--plot {path}: unknown extension {suffix or '(none)'!r}; use .png or .svg")
    return suffix[1:]


def _gib_axis(ax, label: str = "GiB") -> None:
    ax.set_ylabel(label)
    ax.grid(axis="y", color="#e5e5e5")
    ax.set_axisbelow(True)


def _stack(ax, labels: Sequence[str], rows: Sequence[dict[str, int]]) -> None:
    parts = list(dict.fromkeys(k for r in rows for k, v in r.items() if v))
    bottom = [0.0] * len(rows)
    colors = palette(parts)
    for p in parts:
        vals = [r.get(p, 0) / GIB for r in rows]
        ax.bar(labels, vals, bottom=bottom, color=colors[p], label=p)
        bottom = [b + v for b, v in zip(bottom, vals)]
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0), frameon=False)


# estimate ----------------------------------------------------------------------------------------

def plot_phases(result: Any, ax=None):
    """Each phase's live bytes, stacked by ledger; the peak phase outlined and labelled."""
    d = as_dict(result)
    fig, ax = _fig_ax(ax)
    phases = d["phases"]
    _stack(ax, [p["name"] for p in phases], [p.get("parts", {}) for p in phases])
    k = max(range(len(phases)), key=lambda i: phases[i]["bytes"])
    ax.bar([phases[k]["name"]], [phases[k]["bytes"] / GIB], fill=False, edgecolor="#c00", linewidth=2)
    ax.annotate(f"peak {fmt_bytes(phases[k]['bytes'])}", (k, phases[k]["bytes"] / GIB), ha="center",
                va="bottom", color="#c00", fontweight="bold", xytext=(0, 3), textcoords="offset points")
    ax.set_ylim(0, phases[k]["bytes"] / GIB * 1.15)
    ax.tick_params(axis="x", labelrotation=20)
    ax.set_title("live bytes in each phase of the step")
    _gib_axis(ax)
    return fig


def plot_blocks(result: Any, ax=None):
    """Bytes per Transformer block, stacked by ledger."""
    d = as_dict(result)
    fig, ax = _fig_ax(ax)
    per: dict[int, dict[str, int]] = {}
    for it in d.get("items", []):
        li = layer_of(it["name"])
        if li is not None:
            row = per.setdefault(li, {})
            row[it["category"]] = row.get(it["category"], 0) + it["bytes"]
    blocks = sorted(per)
    _stack(ax, [str(b) for b in blocks], [per[b] for b in blocks])
    ax.set_xticks(range(0, len(blocks), max(1, len(blocks) // 16)))
    ax.set_xlabel("block")
    ax.set_title("bytes per block")
    _gib_axis(ax)
    return fig


def plot_ranks(ranks: Sequence[dict], ax=None):
    """Each rank class's ledgers stacked, its peak marked (``ranks`` as in the estimate JSON)."""
    fig, ax = _fig_ax(ax)
    names = [str(r.get("name", i)) for i, r in enumerate(ranks)]
    _stack(ax, names, [r.get("totals_bytes", {}) for r in ranks])
    ax.scatter(names, [r.get("peak_bytes", 0) / GIB for r in ranks], marker="_", s=400, color="#c00",
               label="peak", zorder=3)
    ax.set_title("per rank class")
    _gib_axis(ax)
    return fig


def plot_scaling(sweep: Any, ax=None):
    """Memory against the swept value: the peak and each ledger as points, with a fitted
    a + b·x + c·x² curve (the sweep's own fit when it has one), so linear and quadratic growth
    are told apart at a glance."""
    d = as_dict(sweep)
    fig, ax = _fig_ax(ax)
    over = d.get("over", "value")
    pts = sorted((p for p in d.get("points", []) if p.get("peak_bytes") is not None), key=lambda p: p["value"])
    xs = [p["value"] for p in pts]
    if not xs:
        raise ConfigError("the sweep has no points to plot")
    grid = [xs[0] + (xs[-1] - xs[0]) * k / 100 for k in range(101)]
    fits = d.get("fit") or {}
    ledgers = list(dict.fromkeys(k for p in pts for k, v in p.get("totals_bytes", {}).items() if v))
    colors = palette(ledgers)
    curves = [("peak", [p["peak_bytes"] for p in pts], fits.get("peak"), "#111")]  # black: no ledger's colour
    curves += [(k, [p["totals_bytes"].get(k, 0) for p in pts], fits.get("ledgers", {}).get(k), colors[k])
               for k in ledgers]
    for name, ys, fit, color in curves:
        if fit and fit.get("constant") is not None and fit.get("linear_coef") is not None:
            a, b, c = fit["constant"], fit["linear_coef"], fit.get("quadratic_coef") or 0.0
        else:
            a, b, c = fit_quadratic(xs, ys)
        quad = c * xs[-1] ** 2 > 0.02 * (abs(b) * xs[-1] + abs(a))
        label = f"{name} ({'quadratic' if quad else 'linear'}"
        label += f", exponent {fit['exponent']:.2f})" if fit and fit.get("exponent") is not None else ")"
        ax.plot(xs, [y / GIB for y in ys], "o", color=color, label=label, markersize=4)
        if name == "peak":  # the largest phase, a maximum of polynomials: joined point to point (report/html.py)
            ax.plot(xs, [y / GIB for y in ys], "-", color=color, linewidth=1)
        else:
            ax.plot(grid, [(a + b * x + c * x * x) / GIB for x in grid], "--", color=color, linewidth=1)
    if d.get("budget_bytes"):
        ax.axhline(d["budget_bytes"] / GIB, color="#c00", linewidth=1, label=f"budget {fmt_bytes(d['budget_bytes'])}")
    if d.get("max_fit"):
        ax.axvline(d["max_fit"], color="#2a7f3f", linewidth=1, linestyle=":", label=f"largest that fits: {d['max_fit']:,}")
    ax.set_xlabel({"seq": "sequence length", "batch": "micro-batch"}.get(over, over))
    ax.set_title(f"memory against {over} (points, fitted curves dashed)")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0), frameon=False)
    _gib_axis(ax)
    return fig


def _estimate_figure(result: Any, scaling: dict | None = None):
    """Phases, blocks, and memory against seq and micro-batch when ``scaling`` has those sweeps
    (:func:`trainmem.estimate.scaling.scaling_sweeps`); per rank class when the estimate has
    ``ranks``."""
    d = as_dict(result)
    rows = 3 if d.get("ranks") else 2
    fig, axes = _figure(2, rows, size=(13, 4 * rows))
    plot_phases(d, axes[0])
    plot_blocks(d, axes[1])
    if scaling:
        plot_scaling(scaling["seq"], axes[2])
        plot_scaling(scaling["batch"], axes[3])
    else:
        for ax in axes[2:4]:
            ax.set_axis_off()
    if d.get("ranks"):
        plot_ranks(d["ranks"], axes[4])
        axes[5].set_axis_off()
    return fig


# trace -------------------------------------------------------------------------------------------

_PHASE_COLORS = {"forward": "#e8f1fb", "backward": "#fdf0e6", "optimizer": "#eaf7ea", "step_in_backward": "#eaf7ea"}
TIMELINE_POINTS = 1500


def _category_timeline(result: Any) -> tuple[list[int], dict[str, list[int]]] | None:
    """Allocated bytes per category along the step, from a TraceResult that kept its recording."""
    timeline = getattr(result, "category_timeline", None)
    return timeline(TIMELINE_POINTS) if timeline is not None else None


def plot_timeline(trace: Any, ax=None):
    """The traced step: allocated bytes stacked by category when the recording is at hand (the
    total and the allocator model's reserved bytes from JSON), phase bands, the peak marked."""
    d = as_dict(trace)
    fig, ax = _fig_ax(ax)
    tl = d.get("timeline") or {}
    xs = tl.get("index", [])
    end = (xs[-1] + 1) if xs else 1
    marks = list(tl.get("phases", [])) + [[end, ""]]
    for (a, name), (b, _) in zip(marks, marks[1:]):
        if b > a:
            ax.axvspan(a, b, color=_PHASE_COLORS.get(name, "#f4f4f4"), zorder=0)
            ax.text(a, 1.0, f" {name}", transform=ax.get_xaxis_transform(), va="top", fontsize=8, color="#666")
    by_cat = _category_timeline(trace)
    if by_cat:
        cx, ys = by_cat
        names = [n for n in COLORS if n in ys] + [n for n in ys if n not in COLORS]
        ax.stackplot(cx, *[[v / GIB for v in ys[n]] for n in names], labels=names,
                     colors=[palette(names)[n] for n in names], alpha=0.85)
    elif xs:
        ax.plot(xs, [v / GIB for v in tl["allocated_bytes"]], color="#1f5fbf", label="allocated")
    if xs and tl.get("reserved_bytes"):
        ax.plot(xs, [v / GIB for v in tl["reserved_bytes"]], color="#555", linewidth=1, label="reserved (model)")
    if xs:
        alloc = tl["allocated_bytes"]
        k = max(range(len(alloc)), key=alloc.__getitem__)
        ax.plot([xs[k]], [alloc[k] / GIB], "o", color="#c00")
        where = " / ".join(dict.fromkeys(x for x in (d.get("peak_phase"), d.get("peak_module")) if x))
        ax.annotate(f"peak {fmt_bytes(d.get('peak_bytes', alloc[k]))}\n{where}", (xs[k], alloc[k] / GIB), color="#c00", fontsize=8,
                    xytext=(6, -4), textcoords="offset points", va="top")
    ax.set_xlabel("allocation events")
    ax.set_title("traced step")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0), frameon=False)
    _gib_axis(ax)
    return fig


# compare, plan ------------------------------------------------------------------------------------

def plot_compare(comparison: Any, ax=None, top: int = 20):
    """Estimate and trace bytes of the modules with the most saved activations."""
    d = as_dict(comparison)
    fig, ax = _fig_ax(ax, size=(10, 6))
    rows = sorted(d.get("rows", []), key=lambda r: -max(r.get("estimate_bytes", 0), r.get("trace_bytes", 0)))[:top]
    rows.reverse()
    ys = range(len(rows))
    ax.barh([y + 0.2 for y in ys], [r.get("estimate_bytes", 0) / GIB for r in rows], 0.4, label="estimate", color="#4e79a7")
    ax.barh([y - 0.2 for y in ys], [r.get("trace_bytes", 0) / GIB for r in rows], 0.4, label="trace", color="#f28e2b")
    ax.set_yticks(list(ys), [r.get("name", "") for r in rows], fontsize=7)
    ax.set_xlabel("GiB")
    peak = d.get("peak", {})
    ax.set_title(f"saved activations per module · peak: estimate {fmt_bytes(peak.get('estimate_bytes', 0))}, "
                 f"trace {fmt_bytes(peak.get('trace_bytes', 0))}", fontsize=9)
    ax.legend(fontsize=8, frameon=False)
    return fig


def plot_plan(plan: Any, ax=None):
    """Peak per rank against tokens/s for every candidate; the Pareto front and the usable memory."""
    d = as_dict(plan)
    fig, ax = _fig_ax(ax)
    cands = [c for c in d.get("candidates", []) if c.get("tokens_per_s") is not None]
    for fits, color, label in ((False, "#b8bcc6", "does not fit"), (True, "#2a7f3f", "fits")):
        cs = [c for c in cands if bool(c.get("fits")) == fits]
        if cs:
            ax.scatter([c["tokens_per_s"] for c in cs], [c["peak_bytes"] / GIB for c in cs], s=10, color=color, label=label)
    pareto = sorted((p for p in d.get("pareto", []) if isinstance(p, dict)), key=lambda c: c.get("tokens_per_s") or 0)
    if pareto:
        ax.plot([c["tokens_per_s"] for c in pareto], [c["peak_bytes"] / GIB for c in pareto], "-o", color="#c00",
                markersize=3, label="Pareto front")
    usable = d.get("reserve", {}).get("usable_bytes")
    if usable:
        ax.axhline(usable / GIB, color="#222", linestyle="--", linewidth=1, label=f"usable {fmt_bytes(usable)}")
    ax.set_xlabel("tokens/s")
    ax.set_title("configurations: memory against throughput")
    ax.legend(fontsize=7, frameon=False)
    _gib_axis(ax, "peak per rank (GiB)")
    return fig


# dispatch ---------------------------------------------------------------------------------------

def _fig_ax(ax, size: tuple[float, float] = (9, 4.5)):
    if ax is not None:
        return ax.figure, ax
    fig, axes = _figure(size=size)
    return fig, axes[0]


def figure_for(result: Any, *, scaling: dict | None = None):
    """The figure that suits ``result``: an estimate's phases, blocks and ``scaling``; a trace's
    timeline; a sweep's scaling curves; a comparison; a plan's candidates."""
    d = as_dict(result)
    kind = kind_of(d)
    if kind == "estimate":
        return _estimate_figure(result, scaling)
    if kind == "trace":
        return plot_timeline(result)
    if kind == "sweep":
        return plot_scaling(d)
    if kind == "compare":
        return plot_compare(d)
    if kind == "plan":
        return plot_plan(d)
    if d.get("ranks"):
        return plot_ranks(d["ranks"])
    raise ConfigError(f"no plot for a result of schema {d.get('schema')!r}")


def save_plot(result: Any, path: str | Path, *, scaling: dict | None = None) -> Path:
    """Write :func:`figure_for` ``result`` to ``path`` (``.png`` or ``.svg``) whole or not at all."""
    fmt = check_plot_path(path)
    fig = figure_for(result, scaling=scaling)
    from matplotlib import rc_context

    # a fixed hash salt and no date keep SVG output byte-identical between runs
    with rc_context({"svg.hashsalt": "trainmem"}), atomic_path(path) as tmp:
        fig.savefig(tmp, format=fmt, dpi=110, metadata={"Date": None} if fmt == "svg" else {"Software": None})
    return Path(path)
