"""Sizes for ``--budget``: see :mod:`trainmem.units` (one parser for every command)."""

from trainmem.units import parse_size as _parse_size

__all__ = ["parse_size"]


def parse_size(text: str | int, *, field: str = "budget") -> int:
    return _parse_size(text, field=field)
