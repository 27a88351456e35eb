"""--html and --plot: whole files or none, and rich display in notebooks."""

from __future__ import annotations

import pytest

from trainmem.report.notebook import estimate_html, result_html
from trainmem.report.output import atomic_path, write_outputs
from trainmem.report.units import fmt_bytes

from results import SWEEP, tiny_estimate


class Args:
    html = None
    plot = None


def test_write_outputs_html_only(tmp_path):
    args = Args()
    args.html = str(tmp_path / "sub" / "report.html")
    written = write_outputs(tiny_estimate(), args)
    assert [p.name for p in written] == ["report.html"]
    assert fmt_bytes(tiny_estimate().peak_bytes) in written[0].read_text()
    assert [p.name for p in (tmp_path / "sub").iterdir()] == ["report.html"]  # no temporary left
    assert write_outputs(tiny_estimate(), object()) == []  # a command without the options


def test_interrupted_write_leaves_the_old_file(tmp_path):
    target = tmp_path / "r.html"
    target.write_text("old")
    with pytest.raises(KeyboardInterrupt):
        with atomic_path(target) as tmp:
            open(tmp, "w").write("half")
            raise KeyboardInterrupt
    assert target.read_text() == "old" and [p.name for p in tmp_path.iterdir()] == ["r.html"]


def test_notebook_html():
    e = tiny_estimate()
    html = estimate_html(e)
    assert "trainmem estimate: tiny" in html and fmt_bytes(e.peak_bytes) in html and "<svg" in html
    assert "largest seq that fits" in result_html(SWEEP)
