"""Binary units, for rendering only."""

from __future__ import annotations

__all__ = ["fmt_bytes", "downsample"]


def fmt_bytes(n: int | float) -> str:
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} TiB"


def downsample(values, points: int) -> list[int]:
    """Indices keeping the first, last and each bucket's maximum (a timeline drawn at ``points`` wide)."""
    n = len(values)
    if n <= points:
        return list(range(n))
    step = -(-n // points)
    idx = []
    for start in range(0, n, step):
        end = min(start + step, n)
        idx.append(max(range(start, end), key=values.__getitem__))
    if idx[-1] != n - 1:
        idx.append(n - 1)
    return idx
