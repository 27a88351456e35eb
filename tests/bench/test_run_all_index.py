"""bench/run_all.py regenerates bench/results/README.md's table and keeps the hand-written sections below it
(how to run bench/gpu_validate.py on a lent GPU), which a rerun used to drop."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import run_all  # noqa: E402


def test_sections_from_the_first_level_two_heading_are_kept(tmp_path):
    readme = tmp_path / "README.md"
    readme.write_text("# Benchmark results\n\n| a | b |\n\n## GPU validation\n\nrun it\n\n## More\nx\n")
    assert run_all.kept_sections(readme) == ["", "## GPU validation", "", "run it", "", "## More", "x"]


def test_nothing_kept_without_sections_or_file(tmp_path):
    readme = tmp_path / "README.md"
    assert run_all.kept_sections(readme) == []
    readme.write_text("# Benchmark results\n\n| a | b |\n")
    assert run_all.kept_sections(readme) == []


def test_the_committed_index_keeps_its_gpu_section():
    kept = run_all.kept_sections(Path(run_all.RESULTS) / "README.md")
    assert any(line.startswith("## GPU validation") for line in kept)
