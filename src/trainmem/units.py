"""Memory sizes as the user types them: ``80GiB``, ``512MiB``, ``1.5 TiB``, ``80GB``, ``4096B``.

The one parser every command uses (``--budget``, ``--gpu-memory``, ``--reserve``...), so that
``80G`` means the same everywhere: bare letters are binary, ``GB`` is decimal. A number typed
without a unit is refused (``--budget 80`` meant 80 bytes, silently); bytes are written ``B``.
"""

from __future__ import annotations

import math
import re

from trainmem.errors import SpecError

__all__ = ["parse_size", "describe_size", "SIZE_RULE"]

#: The rule, stated once: every ``--help`` and the docs quote it.
SIZE_RULE = "GiB/G = 2^30 bytes, GB = 10^9 bytes (likewise K, M, T); bytes need a unit: 4096B"

_UNITS = {
    "": 1, "b": 1,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
    "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40,  # bare letters are binary, as in ``ls -h``
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
}
_SIZE = re.compile(r"^\s*((?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE]\+?[0-9]+)?)\s*([a-zA-Z]*)\s*$")


def parse_size(text: str | int, *, field: str = "size") -> int:
    """Bytes in ``text`` (``80GiB`` -> 85899345920). Binary units (KiB, MiB, GiB, TiB and the
    bare letters K, M, G, T) are powers of 1024; KB, MB, GB, TB are powers of 1000."""
    if isinstance(text, int) and not isinstance(text, bool):
        value, unit = float(text), ""
    else:
        m = _SIZE.match(str(text))
        if not m:
            raise SpecError(field, text, "expected a size such as 80GiB, 512MiB or a number of bytes")
        value, unit = float(m.group(1)), m.group(2).lower()
        if not unit:
            raise SpecError(field, text, f"needs a unit: {m.group(1)}GiB, {m.group(1)}GB or {m.group(1)}B "
                                         f"({SIZE_RULE})")
    if unit not in _UNITS:
        raise SpecError(field, text, f"unknown unit {unit!r}; use B, KiB, MiB, GiB, TiB (or KB, MB, GB, TB)")
    if not math.isfinite(value * _UNITS[unit]):
        raise SpecError(field, text, "is too large to be a size")
    n = int(value * _UNITS[unit])
    if n <= 0:
        raise SpecError(field, text, "must be positive")
    return n


def describe_size(text: str | int, *, field: str = "size") -> str:
    """How ``text`` was read, for outputs: ``80GB = 80,000,000,000 bytes = 74.51 GiB``."""
    n = parse_size(text, field=field)
    return f"{str(text).strip()} = {n:,} bytes = {n / 2**30:.2f} GiB"
