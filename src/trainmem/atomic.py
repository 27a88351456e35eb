"""Write files whole or not at all: a temporary file in the same folder, then ``os.replace``.

An interrupted run (Ctrl-C, out-of-memory, a crash) leaves either the old file or none, never
half of a new one. Every command that writes a file (--out, --html, --plot, --snapshot) uses it.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path
from typing import Iterator

__all__ = ["atomic_path", "write_text_atomic"]


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike, suffix: str = "") -> Iterator[str]:
    """Yield a temporary path beside ``path``; it replaces ``path`` only if the block succeeds."""
    final = Path(path)
    final.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{final.name}.", suffix=f".part{suffix}", dir=final.parent)
    os.close(fd)
    try:
        yield tmp
        mask = os.umask(0)
        os.umask(mask)
        os.chmod(tmp, 0o666 & ~mask)  # mkstemp made it private; an output is an ordinary file
        os.replace(tmp, final)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def write_text_atomic(path: str | os.PathLike, text: str) -> None:
    with atomic_path(path) as tmp:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
