"""Growth laws: how a ledger or a term grows with sequence length or micro-batch.

Two fits of the same points, pure functions of numbers:

* the log-log slope (least squares of log y on log x): 1 for a term linear in x, 2 for the
  naive attention scores B·A·S·S over S, 0 for a constant ledger;
* the quadratic ``y ≈ a·x² + b·x + c`` (least squares), whose ``a`` is the quadratic coefficient
  and whose ``b/a`` is where a quadratic part overtakes a linear one.

For ``y = a·x² + b·x`` the local slope is ``1 + a·x/(a·x + b)``, one plus the quadratic share,
so a fitted exponent of 1.5 or more means the quadratic part holds most of the bytes over
most of the range: that is the verdict's threshold.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

__all__ = ["GrowthFit", "fit_growth", "loglog_slope", "quadratic_fit", "verdict", "crossover",
           "QUADRATIC_EXPONENT", "SIGNIFICANT_SHARE"]

QUADRATIC_EXPONENT = 1.5
#: a fitted quadratic part below this share of the value at the end of the range is noise
SIGNIFICANT_SHARE = 1e-3


@dataclass(frozen=True)
class GrowthFit:
    """A fit of y over x. ``exponent`` is None when y is zero everywhere."""

    exponent: float | None
    quadratic_coef: float
    linear_coef: float
    constant: float
    num_points: int

    def to_dict(self) -> dict:
        r = (lambda v: None if v is None else round(v, 6))
        return {"exponent": r(self.exponent), "quadratic_coef": self.quadratic_coef,
                "linear_coef": self.linear_coef, "constant": self.constant, "num_points": self.num_points}


def loglog_slope(xs: Sequence[float], ys: Sequence[float]) -> float | None:
    """Least-squares slope of log y over log x, on the points with y > 0 and x > 0."""
    pts = [(math.log(x), math.log(y)) for x, y in zip(xs, ys) if x > 0 and y > 0]
    if len({p[0] for p in pts}) < 2:
        return None if not pts else 0.0
    mx = sum(p[0] for p in pts) / len(pts)
    my = sum(p[1] for p in pts) / len(pts)
    sxx = sum((p[0] - mx) ** 2 for p in pts)
    sxy = sum((p[0] - mx) * (p[1] - my) for p in pts)
    return sxy / sxx


def _solve(m: list[list[float]], v: list[float]) -> list[float] | None:
    """Gaussian elimination with partial pivoting; None when singular."""
    n = len(v)
    a = [row[:] + [v[i]] for i, row in enumerate(m)]
    for col in range(n):
        piv = max(range(col, n), key=lambda r: abs(a[r][col]))
        if abs(a[piv][col]) < 1e-12:
            return None
        a[col], a[piv] = a[piv], a[col]
        for r in range(n):
            if r != col:
                f = a[r][col] / a[col][col]
                a[r] = [x - f * y for x, y in zip(a[r], a[col])]
    return [a[i][n] / a[i][i] for i in range(n)]


def quadratic_fit(xs: Sequence[float], ys: Sequence[float]) -> tuple[float, float, float]:
    """``(a, b, c)`` minimising Σ(a·x² + b·x + c − y)²; a line (a = 0) below three distinct x."""
    pts = list(zip(xs, ys))
    distinct = len({x for x, _ in pts})
    if distinct == 0:
        return 0.0, 0.0, 0.0
    if distinct == 1:
        return 0.0, 0.0, sum(y for _, y in pts) / len(pts)
    scale = max(abs(x) for x, _ in pts) or 1.0  # fit in u = x/scale for conditioning
    deg = 2 if distinct >= 3 else 1
    powers = [[(x / scale) ** k for k in range(deg, -1, -1)] for x, _ in pts]
    m = [[sum(p[i] * p[j] for p in powers) for j in range(deg + 1)] for i in range(deg + 1)]
    v = [sum(p[i] * y for p, (_, y) in zip(powers, pts)) for i in range(deg + 1)]
    sol = _solve(m, v)
    if sol is None:
        return 0.0, 0.0, sum(y for _, y in pts) / len(pts)
    if deg == 1:
        sol = [0.0, *sol]
    a_u, b_u, c = sol
    return a_u / scale**2, b_u / scale, c


def fit_growth(xs: Sequence[float], ys: Sequence[float]) -> GrowthFit:
    a, b, c = quadratic_fit(xs, ys)
    x_max = max((abs(x) for x in xs), default=0.0)
    floor = 1e-9 * max((abs(y) for y in ys), default=0.0)  # round-off of the solve, not bytes
    a = 0.0 if abs(a) * x_max * x_max <= floor else a
    b = 0.0 if abs(b) * x_max <= floor else b
    c = 0.0 if abs(c) <= floor else c
    return GrowthFit(loglog_slope(xs, ys), a, b, c, len(xs))


def verdict(activation: GrowthFit) -> str:
    """``"quadratic"`` when the fitted exponent is at least 1.5 (the quadratic part holds most
    of the bytes over the range), else ``"linear"``."""
    e = activation.exponent
    return "quadratic" if e is not None and e >= QUADRATIC_EXPONENT else "linear"


def crossover(quadratic_coef: float, linear_coef: float, x_max: float) -> float | None:
    """x where ``a·x²`` overtakes ``b·x``: ``b / a``; None when there is no significant quadratic
    part (its share at ``x_max`` under :data:`SIGNIFICANT_SHARE`) or no linear part."""
    a, b = quadratic_coef, linear_coef
    if a <= 0 or b <= 0:
        return None
    if a * x_max * x_max < SIGNIFICANT_SHARE * b * x_max:
        return None
    return b / a
