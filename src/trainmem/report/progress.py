"""A dependency-free progress bar on stderr, for anything that may take more than a second.

It draws only when the stream is a terminal and only once the work has run for ``delay``
seconds, so quick commands, pipes and CI logs stay clean. It is also a callable
``(fraction_done, label)``, the callback the tracer takes.

>>> with Progress("sweep", total=3) as bar:
...     for _ in range(3):
...         bar.advance()
"""

from __future__ import annotations

import sys
import time
from typing import IO, Iterable, Iterator, TypeVar

__all__ = ["Progress", "progress"]

T = TypeVar("T")
WIDTH = 30


class Progress:
    """``Progress(label, total)``: call :meth:`advance` per unit of work, or call the object
    with a fraction in [0, 1]. ``enabled``: None decides by ``stream.isatty()``."""

    def __init__(self, label: str, total: int | None = None, *, stream: IO[str] | None = None,
                 enabled: bool | None = None, delay: float = 1.0, clock=time.monotonic) -> None:
        self.label = label
        self.total = total
        self.stream = stream if stream is not None else sys.stderr
        if enabled is None:
            isatty = getattr(self.stream, "isatty", None)
            enabled = bool(isatty and isatty())
        self.enabled = enabled
        self.delay = delay
        self._clock = clock
        self._start = clock()
        self._done = 0
        self._last_draw = -1.0
        self._drawn = False

    # the tracer's callback signature
    def __call__(self, fraction: float, note: str = "") -> None:
        self.update(fraction, note)

    def advance(self, n: int = 1, note: str = "") -> None:
        self._done += n
        if self.total:
            self.update(self._done / self.total, note)

    def update(self, fraction: float, note: str = "") -> None:
        if not self.enabled:
            return
        now = self._clock()
        fraction = min(max(fraction, 0.0), 1.0)
        if now - self._start < self.delay or (now - self._last_draw < 0.1 and fraction < 1.0):
            return
        self._last_draw = now
        filled = int(fraction * WIDTH)
        count = f" {self._done}/{self.total}" if self.total else ""
        line = f"\r{self.label} [{'#' * filled}{'.' * (WIDTH - filled)}] {fraction:4.0%}{count} {note:<16.16}"
        self.stream.write(line)
        self.stream.flush()
        self._drawn = True

    def close(self) -> None:
        """End the line if anything was drawn (a quick job leaves no trace)."""
        if self._drawn:
            self.stream.write("\n")
            self.stream.flush()
            self._drawn = False

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def progress(items: Iterable[T], label: str, *, total: int | None = None, **kwargs) -> Iterator[T]:
    """Yield ``items`` while drawing a bar (see :class:`Progress` for the keyword arguments)."""
    if total is None and hasattr(items, "__len__"):
        total = len(items)  # type: ignore[arg-type]
    with Progress(label, total, **kwargs) as bar:
        for item in items:
            yield item
            bar.advance()
