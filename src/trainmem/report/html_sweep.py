"""The HTML page of a sweep (schema ``trainmem.sweep``): points, fitted curves and their growth."""

from __future__ import annotations

from typing import Sequence

from trainmem.report.html_base import _Page, _layout, line_chart, palette, table
from trainmem.report.units import fmt_bytes


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
