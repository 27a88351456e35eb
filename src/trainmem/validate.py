"""Small validators shared by the spec dataclasses and the family registry. Each raises SpecError
naming field and value.

A top-level module that imports only :mod:`trainmem.errors`: the specs import the family
registry, so the registry validates config values through this module, not through the specs.
"""

from __future__ import annotations

from typing import Iterable

from trainmem.errors import SpecError

MAX_DIM = 10**9  # a dimension past this is a typo, not a model


def positive(field: str, value: object, *, maximum: int = MAX_DIM) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise SpecError(field, value, "must be an integer")
    if value <= 0:
        raise SpecError(field, value, "must be positive")
    if value > maximum:
        raise SpecError(field, value, f"is implausibly large (max {maximum})")


def non_negative(field: str, value: object, *, maximum: int = MAX_DIM) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise SpecError(field, value, "must be an integer")
    if value < 0:
        raise SpecError(field, value, "must not be negative")
    if value > maximum:
        raise SpecError(field, value, f"is implausibly large (max {maximum})")


def probability(field: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise SpecError(field, value, "must be a number in [0, 1)")
    if not 0.0 <= float(value) < 1.0:
        raise SpecError(field, value, "must be in [0, 1)")


def one_of(field: str, value: object, choices: Iterable[str]) -> None:
    choices = tuple(choices)
    if value not in choices:
        raise SpecError(field, value, f"must be one of {', '.join(choices)}")


def boolean(field: str, value: object) -> None:
    if not isinstance(value, bool):
        raise SpecError(field, value, "must be true or false")
