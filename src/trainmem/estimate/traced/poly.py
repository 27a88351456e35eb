"""Exact polynomials in B and S: fit a tensor's sizes from a few traced (B, S) points.

A saved tensor's axis length (and its bytes) is taken to be ``Σ c_ij·B^i·S^j`` with ``i <= 1``
and ``j <= 2`` (six terms: 1, B, S, B·S, S², B·S²). Six traced points on the grid
``B ∈ {b1, b2} × S ∈ {s1, s2, s3}`` determine the coefficients exactly (a tensor-product
interpolation, solved in rational arithmetic); one more point off the grid checks them. A
length that is not such a polynomial (a ``⌈S/64⌉``, a data-dependent count) fails the check and
is refused, never rounded. A grid with one batch size (B = 1: its tensors have degenerate
strides, so PyTorch skips some copies and saves other tensors) fits S alone, valid at that B.

Pure arithmetic: no torch, no I/O.
"""

from __future__ import annotations

import math
from fractions import Fraction
from typing import Sequence

__all__ = ["TERMS", "Poly", "fit", "grid_points", "render"]

#: (power of B, power of S) of each coefficient, in order.
TERMS: tuple[tuple[int, int], ...] = ((0, 0), (1, 0), (0, 1), (1, 1), (0, 2), (1, 2))

Poly = tuple[Fraction, ...]  # one coefficient per TERMS entry


def grid_points(s_values: Sequence[int], b_values: Sequence[int] = (2, 3)) -> tuple[tuple[int, int], ...]:
    """The fitting points: every batch size of ``b_values`` (one or two) at three sequence lengths."""
    if len(s_values) != 3 or len(set(s_values)) != 3 or len(set(b_values)) not in (1, 2):
        raise ValueError(f"three sequence lengths and one or two batch sizes are needed, got {s_values}, {b_values}")
    return tuple((b, s) for s in s_values for b in b_values)


def _lagrange(xs: Sequence[int], values: Sequence[Fraction]) -> list[Fraction]:
    """Coefficients (constant first) of the polynomial of degree < len(xs) through the points."""
    n = len(xs)
    out = [Fraction(0)] * n
    for i, (xi, yi) in enumerate(zip(xs, values)):
        basis = [Fraction(1)]  # ∏_{j≠i} (x - xj) / (xi - xj), built term by term
        denom = Fraction(1)
        for j, xj in enumerate(xs):
            if j == i:
                continue
            basis = [Fraction(0)] + basis  # multiply by x
            for k in range(len(basis) - 1):
                basis[k] -= xj * basis[k + 1]
            denom *= xi - xj
        for k, c in enumerate(basis):
            out[k] += yi * c / denom
    return out


def fit(points: Sequence[tuple[int, int]], values: Sequence[int]) -> Poly:
    """The coefficients (in :data:`TERMS` order) of the polynomial through ``values`` at
    :func:`grid_points`: along S at each batch size, then linear in B (B terms are 0 when the
    grid has one batch size). Points at one S give a fit in B alone, valid at that S only (its
    constant term holds the S-dependence there)."""
    by_b: dict[int, dict[int, int]] = {}
    for (b, s), v in zip(points, values):
        by_b.setdefault(b, {})[s] = v
    rows = list(by_b.values())
    if len(rows) not in (1, 2) or any(len(r) not in (1, 3) or r.keys() != rows[0].keys() for r in rows):
        raise ValueError(f"points must be grid_points(...) or batch sizes at one S, got {tuple(points)}")
    ss = sorted(rows[0])
    along = {b: (_lagrange(ss, [Fraction(row[s]) for s in ss]) + [Fraction(0)] * 2)[:3] for b, row in by_b.items()}
    if len(along) == 1:
        (b1, y1), = along.items()
        slope, const = [Fraction(0)] * 3, y1
    else:
        (b1, y1), (b2, y2) = sorted(along.items())
        slope = [(c2 - c1) / (b2 - b1) for c1, c2 in zip(y1, y2)]
        const = [c1 - d * b1 for c1, d in zip(y1, slope)]
    coeff = {(0, j): const[j] for j in range(3)} | {(1, j): slope[j] for j in range(3)}
    return tuple(coeff[t] for t in TERMS)


def value(poly: Poly, B: int, S: int) -> Fraction:
    """The polynomial's exact value at (B, S)."""
    return sum((c * B ** i * S ** j for c, (i, j) in zip(poly, TERMS) if c), Fraction(0))


def _monomial(i: int, j: int) -> str:
    return "·".join(["B"] * i + (["S"] if j == 1 else ["S·S"] if j == 2 else []))


def render(poly: Poly) -> str:
    """A dims-style expression (:mod:`trainmem.estimate.symbols`): ``B·S``, ``2·B·S+S``,
    ``B·S·S/2``, ``4096``. Terms from the highest power of S down."""
    parts: list[str] = []
    order = sorted(range(len(TERMS)), key=lambda k: (-TERMS[k][1], -TERMS[k][0]))
    for k in order:
        c = poly[k]
        if not c:
            continue
        i, j = TERMS[k]
        mono = _monomial(i, j)
        mag = abs(c)
        if not mono:
            term = str(mag.numerator) if mag.denominator == 1 else f"{mag.numerator}/{mag.denominator}"
        else:
            term = mono if mag.numerator == 1 else f"{mag.numerator}·{mono}"
            if mag.denominator != 1:
                term += f"/{mag.denominator}"
        parts.append(("-" if c < 0 else "+" if parts else "") + term)
    return "".join(parts) or "0"


def to_json(poly: Poly) -> list[int]:
    """Integer numerators over one common denominator, last: exact and quick to evaluate."""
    den = math.lcm(*(c.denominator for c in poly))
    return [int(c * den) for c in poly] + [den]


def from_json(data: Sequence[int]) -> Poly:
    return tuple(Fraction(n, data[-1]) for n in data[:-1])


def value_int(data: Sequence[int], B: int, S: int) -> tuple[int, int]:
    """:func:`value` of a :func:`to_json` polynomial in integers: (quotient, remainder)."""
    n0, n1, n2, n3, n4, n5, den = data
    return divmod(n0 + n1 * B + S * (n2 + n3 * B + S * (n4 + n5 * B)), den)
