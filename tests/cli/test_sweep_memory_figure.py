"""``sweep --budget B --memory-figure reserved`` decides fit with the reserved peak, as ``--gpu`` does.

It printed the allocated column and decided fit with allocated: llama-3-8b at S 64-1024 is 74.79 GiB
allocated but 75.52-75.94 GiB reserved, so under a 75.5 GiB budget every point "fit" that the
caching-allocator model says runs only by flushing its cache, or not at all.
"""

from __future__ import annotations

import json

from trainmem.cli import main


def _sweep(capsys, *extra) -> dict:
    assert main(["sweep", "--model", "llama-3-8b", "--over", "seq", "--budget", "75.5GiB", "--max", "512",
                 "--json", *extra]) == 0
    return json.loads(capsys.readouterr().out)


def test_reserved_figure_decides_the_fit(capsys):
    allocated = _sweep(capsys)
    reserved = _sweep(capsys, "--memory-figure", "reserved")
    budget = 75.5 * 2**30
    assert all(p["fits"] and p["peak_bytes"] <= budget for p in allocated["points"])
    for p in reserved["points"]:
        assert p["peak_reserved_bytes"] > budget  # the allocator model's reserved peak, over the budget
        assert not p["fits"]
    assert reserved["max_fit"] is None
