"""One small error hierarchy: every exception trainmem raises on purpose is defined here.

The CLI prints ``Type: message`` and exits 2 for every :class:`TrainmemError`. The modules that
raise these also re-export them under their old names (``trainmem.measure.OutOfMemory``,
``trainmem.measure_dist.DistributedRunError``, ``trainmem.report.plots.PlotDependencyError``,
``trainmem.integrations.DoesNotFit``, ``trainmem.serve.request.RequestError``).
"""

from __future__ import annotations

__all__ = ["TrainmemError", "SpecError", "ConfigError", "UnsupportedError", "OutOfMemory",
           "DistributedRunError", "PlotDependencyError", "DoesNotFit", "RequestError", "HTTPStatusError"]


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


class OutOfMemory(TrainmemError):
    """The device ran out of memory during a measured step (memory was released afterwards)."""


class DistributedRunError(TrainmemError):
    """A torchrun launch failed, timed out, or a rank wrote no result."""


class PlotDependencyError(TrainmemError, ImportError):
    """matplotlib is not installed."""


class DoesNotFit(TrainmemError):
    """The predicted peak exceeds the device's usable memory and ``on_oom="stop"``; ``check`` is
    the :class:`trainmem.integrations.check.Check` that says so."""

    def __init__(self, message: str, check: object) -> None:
        super().__init__(message)
        self.check = check


class RequestError(TrainmemError):
    """A request the page or an API client got wrong: unknown field, wrong JSON type."""


class HTTPStatusError(TrainmemError):
    """``trainmem serve`` answers a request with this HTTP ``status`` (403, 404, 405, 411, 413, 415 or
    400 for a body that is not JSON) and the message as its one-line JSON error."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
