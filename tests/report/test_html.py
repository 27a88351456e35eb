"""The HTML report: self-contained, and what a person sees in a real browser."""

from __future__ import annotations

import json
import re
import xml.etree.ElementTree as ET

import pytest

from trainmem.report.html import fit_quadratic, html_fragment, kind_of, to_html, write_html
from trainmem.report.units import fmt_bytes

from browser import dump_dom, png_pixels, screenshot
from results import COMPARE, PLAN, SWEEP, TRACE, tiny_estimate

ALL = {"sweep": SWEEP, "plan": PLAN, "compare": COMPARE, "trace": TRACE}


def offline(page: str) -> None:
    """Nothing is fetched: no external scripts, styles, images or fonts."""
    assert not re.search(r"""(src|href)\s*=|@import|url\(""", page)
    assert set(re.findall(r"https?://[^\s\"'<>]+", page)) <= {"http://www.w3.org/2000/svg"}


def test_every_schema_renders_offline_with_well_formed_svg():
    pages = {"estimate": to_html(tiny_estimate()), **{k: to_html(v) for k, v in ALL.items()}}
    for kind, page in pages.items():
        offline(page)
        svgs = re.findall(r"<svg.*?</svg>", page, flags=re.S)
        assert svgs, kind
        for svg in svgs:
            ET.fromstring(svg)  # each chart is well-formed XML
    assert kind_of({"schema": "trainmem.nothing/1"}) == "result"
    assert "<table" in to_html({"schema": "trainmem.nothing/1", "peak_bytes": 2**30, "rows": [{"a": 1}]})


def test_names_are_escaped():
    d = json.loads(json.dumps(COMPARE))
    d["rows"][0]["name"] = "<script>alert(1)</script>"
    page = to_html(d)
    assert "<script>alert(1)" not in page and "&lt;script&gt;alert(1)&lt;/script&gt;" in page
    e = tiny_estimate().to_dict()
    e["items"][0]["name"] = "</script><b>x"
    assert "</script><b>x" not in to_html(e)


def test_fit_quadratic_exact():
    # y = 3 + 2x + 0.5x² at x = 1..4 -> 5.5, 9, 13.5, 19
    a, b, c = fit_quadratic([1, 2, 3, 4], [5.5, 9, 13.5, 19])
    assert (round(a, 9), round(b, 9), round(c, 9)) == (3, 2, 0.5)
    assert fit_quadratic([2, 4], [10, 20]) == (0.0, 5.0, 0.0)


def test_fragment_for_notebooks_has_no_script():
    frag = html_fragment(tiny_estimate())
    assert frag.startswith('<div class="tm">') and "<script" not in frag
    assert fmt_bytes(tiny_estimate().peak_bytes) in frag


def test_estimate_in_chromium(tmp_path):
    e = tiny_estimate()
    page = write_html(e, tmp_path / "estimate.html", title="tiny estimate")
    dom = dump_dom(page, tmp_path)
    assert 'data-ready="1"' in dom  # the script ran to its end
    assert fmt_bytes(e.peak_bytes) in dom and "peak (optimizer)" in dom
    for ledger in ("parameter", "gradient", "optimizer_state", "activation"):
        assert f"<td>{ledger}</td>" in dom
    # the script filled the tensor table: every tensor, sorted by size
    assert f"showing {len(e.inventory)} of {len(e.inventory)} tensors" in dom
    biggest = max(e.inventory, key=lambda i: i.bytes)
    assert f"<td>{biggest.name}</td>" in dom


@pytest.mark.parametrize("kind, needles", [
    ("sweep", ["largest seq that fits", "12,288", "quadratic", "Memory against seq"]),
    ("plan", ["best tokens/s", "Pareto front", "tp=2 pp=2 batch=1"]),
    ("compare", ["estimate / trace", "model.layers.0.self_attn", "1.049"]),
    ("trace", ["peak allocated", "5.00 MiB", "backward / model.layers.1.mlp / mm", "Timeline"]),
])
def test_other_results_in_chromium(tmp_path, kind, needles):
    page = write_html(ALL[kind], tmp_path / f"{kind}.html")
    dom = dump_dom(page, tmp_path)
    assert 'data-ready="1"' in dom
    for n in needles:
        assert n in dom, n


def test_screenshot_is_not_blank(tmp_path):
    page = write_html(tiny_estimate(), tmp_path / "estimate.html")
    png = screenshot(page, tmp_path / "shot.png", tmp_path)
    pixels = png_pixels(png)
    assert len(set(pixels)) > 20  # a blank page decodes to a handful of values
