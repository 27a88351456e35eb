"""Text output at most 120 columns wide: long lines wrapped at word boundaries.

A wrapped line keeps its own indent and continues under it, two columns further (three after an
``A: ``/``Q: `` answer, past a ``- `` bullet's dash). A command line (``trainmem …``) wraps with
a trailing `` \\`` so it still pastes into a shell. Columns of a table are the renderer's to keep
narrow; this only catches prose.
"""

from __future__ import annotations

import io
import re
import textwrap

__all__ = ["WIDTH", "wrap_line", "wrap_text", "WrappingWriter"]

WIDTH = 120
_COMMAND = re.compile(r"(\$ )?trainmem [\w-]+ (?!—)")  # not a report's title ("trainmem plan — ...")


def _hang(body: str) -> int:
    return 3 if body.startswith(("A: ", "Q: ")) else 2


def wrap_line(line: str, width: int = WIDTH) -> str:
    """``line`` as one or more lines of at most ``width`` columns (a word longer than that stays whole)."""
    if len(line) <= width:
        return line
    indent = line[: len(line) - len(line.lstrip(" "))]
    body = line[len(indent):]
    command = _COMMAND.match(body) is not None
    rest = indent + " " * (4 if command else _hang(body))
    parts = textwrap.wrap(body, width=width - (2 if command else 0), initial_indent=indent, subsequent_indent=rest,
                          break_long_words=False, break_on_hyphens=False)
    return (" \\\n" if command else "\n").join(parts)


def wrap_text(text: str, width: int = WIDTH) -> str:
    return "\n".join(wrap_line(line, width) for line in text.split("\n"))


class WrappingWriter(io.TextIOBase):
    """A stdout that wraps each complete line as it is written (a partial line waits for its newline
    or for :meth:`flush`), so long-running commands still stream."""

    def __init__(self, out, width: int = WIDTH) -> None:
        self._out, self._width, self._pending = out, width, ""

    def writable(self) -> bool:
        return True

    def write(self, s: str) -> int:
        self._pending += s
        if "\n" in self._pending:
            done, self._pending = self._pending.rsplit("\n", 1)
            self._out.write(wrap_text(done, self._width) + "\n")
        return len(s)

    def flush(self) -> None:
        if self._pending:
            self._out.write(wrap_line(self._pending, self._width))
            self._pending = ""
        self._out.flush()

    def isatty(self) -> bool:
        return self._out.isatty()

    def fileno(self) -> int:
        return self._out.fileno()
