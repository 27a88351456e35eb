"""A per-thread flag that is on inside a ``with`` block (nested blocks count): what the tracer's
dispatch hooks ask of the code that makes a tensor (a host copy, a paged optimizer state)."""

from __future__ import annotations

import contextlib
import threading
from typing import Iterator

__all__ = ["ScopedFlag"]


class ScopedFlag:
    """``active()`` is True while some ``scope()`` block of this thread is open."""

    def __init__(self) -> None:
        self._local = threading.local()

    def active(self) -> bool:
        return getattr(self._local, "depth", 0) > 0

    @contextlib.contextmanager
    def scope(self) -> Iterator[None]:
        self._local.depth = getattr(self._local, "depth", 0) + 1
        try:
            yield
        finally:
            self._local.depth -= 1
