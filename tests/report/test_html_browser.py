"""The --html pages of estimate, compare, trace, sweep and plan in headless Chromium (Playwright on
the system's Chromium, as tests/serve does): what a person sees, checked on the rendered page.

- subtitles carry the model's name (not "custom") and the parallel layout;
- trace.html: the y-axis labels lie inside the svg, the phase bands are labelled;
- sweep.html: each series' line passes through its points (the points are vertices of the path);
- one colour per ledger in a chart's legend;
- no Python reprs in the visible text.

Screenshots go to $TRAINMEM_SHOTS (default /tmp/shots) for a person to look at. Skipped without
Chromium or Playwright; slow (five commands, then a browser: about a minute on two loaded cores).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from trainmem.cli import main

TINY = dict(model_type="llama", hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=500, max_position_embeddings=256)
REPRS = ("None", "{'", "[(", "<trainmem.", "custom")
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def pages(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("pages")
    cfg = tmp / "tiny-llama" / "config.json"
    cfg.parent.mkdir()
    cfg.write_text(json.dumps(TINY))
    runs = {
        "estimate": ["estimate", "--model", "gpt2", "--seq", "256", "--tp", "2", "--dp", "2", "--zero", "1"],
        "sweep": ["sweep", "--model", "gpt2", "--over", "seq", "--budget", "8GiB", "--attention", "eager"],
        "plan": ["plan", "--model", "gpt2", "--gpu", "H100-80GB", "--gpus", "8"],
        "trace": ["trace", "--model", str(cfg.parent), "--seq", "32", "--precision", "fp32"],
        "compare": ["compare", "--model", str(cfg.parent), "--seq", "32", "--precision", "fp32"],
    }
    out = {}
    for name, argv in runs.items():
        if name in ("trace", "compare"):
            pytest.importorskip("torch")
        out[name] = tmp / f"{name}.html"
        assert main([*argv, "--html", str(out[name])]) == 0
    return out


@pytest.fixture(scope="module")
def browser():
    chromium = os.environ.get("TRAINMEM_CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")
    if not chromium:
        pytest.skip("headless Chromium not installed (apt-get install chromium)")
    sync_api = pytest.importorskip("playwright.sync_api", reason="playwright not installed (requirements-dev.txt)")
    with sync_api.sync_playwright() as pw:
        b = pw.chromium.launch(executable_path=chromium, args=["--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage"])
        yield b
        b.close()


def _open(browser, path: Path):
    page = browser.new_page(viewport={"width": 1200, "height": 900})
    page.goto(path.resolve().as_uri())
    shots = Path(os.environ.get("TRAINMEM_SHOTS", "/tmp/shots"))
    shots.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(shots / f"{path.stem}.png"))  # the first screen: a full estimate page is slow
    return page


@pytest.mark.parametrize("name,model,layout", [
    ("estimate", "gpt2", "tp2 dp2 zero1"), ("sweep", "gpt2", "one GPU"), ("plan", "gpt2", "8 × H100-80GB"),
    ("trace", "LlamaForCausalLM", "batch 1, seq 32, fp32"), ("compare", "tiny-llama", "B=1 S=32 · fp32"),
])
def test_subtitle_names_the_model_and_layout_and_no_reprs(pages, browser, name, model, layout):
    page = _open(browser, pages[name])
    sub = page.inner_text(".sub")
    assert model in sub and layout in sub, sub
    text = page.inner_text("body")
    assert not [r for r in REPRS if r in text], [r for r in REPRS if r in text]
    page.close()


def test_trace_axis_labels_inside_and_phase_bands_labelled(pages, browser):
    page = _open(browser, pages["trace"])
    svg = page.query_selector("svg").bounding_box()
    labels = page.query_selector_all("svg text.ylabel")
    assert len(labels) == 5
    for label in labels:
        box = label.bounding_box()
        assert box["x"] >= svg["x"] and box["x"] + box["width"] <= svg["x"] + svg["width"], label.text_content()
    key = [t.text_content() for t in page.query_selector_all("svg text.phase-key")]
    assert {"forward", "backward", "optimizer"} <= set(key), key  # every band in the key
    over = [t.text_content() for t in page.query_selector_all("svg text.phase")]
    assert {"forward", "backward"} <= set(over), over  # and over the bands wide enough for their name
    page.close()


def _points(attr: str) -> list[tuple[float, float]]:
    return [tuple(map(float, p.split(","))) for p in attr.split()]


def test_sweep_lines_pass_through_their_points(pages, browser):
    page = _open(browser, pages["sweep"])
    svg = page.query_selector_all("svg")[0]
    lines = [(pl.get_attribute("stroke"), _points(pl.get_attribute("points")))
             for pl in svg.query_selector_all("polyline")]
    dots: dict[str, list[tuple[float, float]]] = {}
    for c in svg.query_selector_all("circle"):
        dots.setdefault(c.get_attribute("fill"), []).append((float(c.get_attribute("cx")), float(c.get_attribute("cy"))))
    assert len(dots) >= 4  # the peak and the ledgers that are not zero
    for color, pts in dots.items():
        path = next(p for stroke, p in lines if stroke == color)
        for x, y in pts:  # a vertex of the path at the point's x, within the 0.1 px the coordinates are rounded to
            assert any(abs(px - x) <= 0.1 and abs(py - y) <= 0.6 for px, py in path), (color, x, y)
    page.close()


@pytest.mark.parametrize("name", ["estimate", "sweep"])
def test_one_colour_per_ledger(pages, browser, name):
    page = _open(browser, pages[name])
    svg = page.query_selector_all("svg")[0]
    legend = [el.get_attribute("fill") or el.get_attribute("stroke")
              for el in svg.query_selector_all("rect[width='10'], line[stroke-width='3']")]
    assert len(legend) >= 4 and len(set(legend)) == len(legend), legend
    page.close()
