"""``--html`` and ``--plot`` for every command: write the files whole or not at all.

Each file is written to a temporary name in the same folder and renamed over the target, so an
interrupted run (Ctrl-C, a crash) leaves the old file or none, never half of a new one.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from trainmem.atomic import atomic_path, write_text_atomic

__all__ = ["write_outputs", "atomic_path", "write_text_atomic", "say_wrote"]


def say_wrote(path: str | Path) -> Path:
    """Tell the user, on stderr (stdout may be JSON), where a file went: ``wrote FILE``."""
    import sys

    sys.stderr.write(f"wrote {path}\n")
    return Path(path)


def write_outputs(result: Any, args: Any, *, title: str | None = None, scaling: dict | None = None) -> list[Path]:
    """Write ``args.html`` (a self-contained page) and ``args.plot`` (``.png`` or ``.svg``) for
    ``result`` (a trainmem result or its ``to_dict()``); missing attributes mean "not asked".
    ``scaling``: an estimate's sweeps for its plot (:func:`trainmem.estimate.scaling.scaling_sweeps`).
    Says ``wrote FILE`` on stderr for each; returns the paths written."""
    written: list[Path] = []
    html_path = getattr(args, "html", None)
    plot_path = getattr(args, "plot", None)
    if plot_path:  # check the extension before any work
        from trainmem.report.plots import check_plot_path
        check_plot_path(plot_path)
    if html_path:
        from trainmem.report.html import write_html
        written.append(say_wrote(write_html(result, html_path, title=title)))
    if plot_path:
        from trainmem.report.plots import save_plot
        written.append(say_wrote(save_plot(result, plot_path, scaling=scaling)))
    return written
