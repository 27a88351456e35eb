"""One small error hierarchy. The CLI prints ``Type: message`` and exits 2 for these."""

from __future__ import annotations

__all__ = ["TrainmemError", "SpecError", "ConfigError", "UnsupportedError"]


class TrainmemError(Exception):
    """Base class for every error trainmem raises on purpose."""


class SpecError(TrainmemError, ValueError):
    """A specification field has a value that cannot be right.

    The message always names the field and the value.
    """

    def __init__(self, field: str, value: object, why: str) -> None:
        self.field = field
        self.value = value
        super().__init__(f"{field}={value!r}: {why}")


class ConfigError(TrainmemError):
    """A config file or preset could not be read."""


class UnsupportedError(TrainmemError):
    """The input is well formed but trainmem does not model it."""
