"""The page in headless Chromium, driven by Playwright: change a control, see the numbers and the
chart change, and check what the page shows against ``trainmem estimate --json``. A screenshot
goes to the test's tmp_path and, when set, to ``$TRAINMEM_ARTIFACTS``.

Skipped only when Chromium or Playwright is missing (``requirements-dev.txt`` pins Playwright;
it drives the system's Chromium and downloads no browser)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from serve_helpers import cli_json, running_server
from trainmem.plan.hardware import Reserve, load_gpu

FLAGS = ["--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--disable-background-networking",
         "--disable-component-update", "--disable-sync", "--no-first-run"]


@pytest.fixture(scope="module")
def page():
    chromium = os.environ.get("TRAINMEM_CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")
    if not chromium:
        pytest.skip("headless Chromium not installed (apt-get install chromium)")
    sync_api = pytest.importorskip("playwright.sync_api", reason="playwright not installed (requirements-dev.txt)")
    with running_server() as base, sync_api.sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=chromium, args=FLAGS)
        # Playwright evaluates its wait conditions as strings, which the page's CSP forbids
        # (tests/serve/test_serve_api.py checks the CSP header itself)
        p = browser.new_page(viewport={"width": 1280, "height": 1000}, bypass_csp=True)
        p.requests = []
        p.on("request", lambda r: p.requests.append(r.url))
        p.goto(base + "/")
        p.base = base
        yield p
        browser.close()


def _settle(page) -> None:
    """Wait for the estimate and the search for what fits to land for the current controls (a
    change marks the page as loading at once, before its 200 ms pause)."""
    page.wait_for_function("document.body.dataset.state !== 'loading' && document.body.dataset.fit !== 'loading'",
                           timeout=120_000)


def _shown(page) -> dict:
    """What a person reads: the peak card's byte count and the ledger table's bytes column."""
    peak_text = page.text_content("#peak .x")  # "12,345 bytes · phase"
    ledgers = {}
    for row in page.query_selector_all("#ledgers tbody tr"):
        cells = [c.text_content().strip() for c in row.query_selector_all("td")]
        ledgers[cells[0]] = int(cells[1].replace(",", ""))
    return {"peak_bytes": int(peak_text.split(" bytes")[0].replace(",", "")), "totals_bytes": ledgers,
            "phase": peak_text.split(" · ")[1], "chart": page.inner_html("#chart"),
            "verdict": page.get_attribute("#verdict", "class"), "error_hidden": page.is_hidden("#error"),
            "largest_batch": page.get_attribute("#largest-batch", "data-value")}


def _assert_matches_cli(shown: dict, cli: dict) -> None:
    assert shown["peak_bytes"] == cli["peak_bytes"]
    assert shown["totals_bytes"] == cli["totals_bytes"]
    assert shown["phase"] == cli["peak_phase"]


@pytest.mark.slow  # ~11 s on CI's two cores (headless Chromium, four estimates and fit searches)
def test_controls_update_numbers_and_chart(page, capsys, tmp_path):
    page.fill("#f-model", "gpt2")
    page.dispatch_event("#f-model", "change")
    _settle(page)
    first = _shown(page)
    _assert_matches_cli(first, cli_json(capsys, ["estimate", "--model", "gpt2", "--json"]))
    h100 = load_gpu("H100-80GB")
    usable = Reserve.modelled(h100).reserved_usable_bytes(h100)  # the reserved figure's budget, as advise's
    assert first["verdict"] == "verdict ok" and first["peak_bytes"] <= usable
    assert int(first["largest_batch"]) > 1

    page.fill("#f-batch", "4")
    _settle(page)
    second = _shown(page)
    _assert_matches_cli(second, cli_json(capsys, ["estimate", "--model", "gpt2", "--batch", "4", "--json"]))
    assert second["peak_bytes"] > first["peak_bytes"] and second["chart"] != first["chart"]

    page.select_option("#f-precision", "fp32")
    page.select_option("#f-attention", "eager")
    _settle(page)
    third = _shown(page)
    _assert_matches_cli(third, cli_json(capsys, ["estimate", "--model", "gpt2", "--batch", "4", "--precision",
                                                 "fp32", "--attention", "eager", "--json"]))
    assert third["chart"] != second["chart"]
    assert page.text_content("#command") == ("trainmem estimate --model=gpt2 --batch=4 --precision=fp32 "
                                             "--attention=eager --json")

    # a GPU that is too small: the verdict turns and the advisor's fixes appear
    page.select_option("#f-gpu", "l4")
    page.fill("#f-batch", "32")
    _settle(page)
    small = _shown(page)
    cli = cli_json(capsys, ["estimate", "--model", "gpt2", "--batch", "32", "--precision", "fp32", "--attention",
                            "eager", "--json"])
    _assert_matches_cli(small, cli)
    l4 = load_gpu("l4")  # allocated over the budget: the reserved peak (>= allocated) is too
    assert cli["peak_bytes"] > Reserve.modelled(l4).reserved_usable_bytes(l4) and small["verdict"] == "verdict bad"
    advice = cli_json(capsys, ["advise", "--model", "gpt2", "--batch", "32", "--precision", "fp32", "--attention",
                               "eager", "--gpu", "l4", "--json"])
    fixes = [li.text_content() for li in page.query_selector_all("#fixes > li")]
    assert len(fixes) == len(advice["steps"]) > 0
    assert all(f.startswith(s["action"]) for f, s in zip(fixes, advice["steps"]))

    _save_screenshot(page, tmp_path)

    # a value the CLI refuses: its one-line message under the controls, the old numbers kept
    page.fill("#f-batch", "0")
    _settle(page)
    assert page.text_content("#error") == "argument --batch: --batch=0: must be positive"
    assert _shown(page)["peak_bytes"] == small["peak_bytes"]
    # what the browser cannot read as a number is refused on the page, not sent as "no value"
    page.fill("#f-batch", "")
    page.type("#f-batch", "1e")
    _settle(page)
    assert page.text_content("#error") == "batch: not a number"

    # nothing was fetched from anywhere but this server
    assert page.requests and all(u.startswith(page.base + "/") for u in page.requests), page.requests


def _save_screenshot(page, tmp_path: Path) -> None:
    shot = tmp_path / "serve.png"
    page.screenshot(path=str(shot), full_page=True)
    assert shot.stat().st_size > 10_000
    out = os.environ.get("TRAINMEM_ARTIFACTS")
    if out:
        Path(out).mkdir(parents=True, exist_ok=True)
        shutil.copy(shot, Path(out) / "serve.png")
