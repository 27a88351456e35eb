"""Plots are written as valid PNG and SVG, for every kind of result."""

from __future__ import annotations

import xml.etree.ElementTree as ET

import pytest

from trainmem.errors import ConfigError, SpecError
from trainmem.estimate.scaling import scaling_points, scaling_sweeps
from trainmem.report.output import write_outputs

from results import COMPARE, PLAN, SWEEP, TRACE, tiny_estimate

pytest.importorskip("matplotlib")

from trainmem.report.plots import figure_for, save_plot  # noqa: E402

PNG = b"\x89PNG\r\n\x1a\n"


def is_svg(path) -> bool:
    root = ET.parse(path).getroot()
    return root.tag == "{http://www.w3.org/2000/svg}svg"


@pytest.mark.parametrize("name, result", [("sweep", SWEEP), ("plan", PLAN), ("compare", COMPARE), ("trace", TRACE)])
def test_each_schema_as_png_and_svg(tmp_path, name, result):
    assert save_plot(result, tmp_path / f"{name}.png").read_bytes()[:8] == PNG
    assert is_svg(save_plot(result, tmp_path / f"{name}.svg"))


@pytest.mark.slow  # ~6 s on CI's two cores (13 s on the loaded shared machine)
def test_estimate_gets_scaling_panels_from_its_sweeps(tmp_path):
    e = tiny_estimate()
    scaling = scaling_sweeps(e)
    fig = figure_for(e, scaling=scaling)
    titles = [ax.get_title() for ax in fig.axes]
    assert "memory against seq (points, fitted curves dashed)" in titles
    assert "memory against batch (points, fitted curves dashed)" in titles
    out = save_plot(e, tmp_path / "e.svg", scaling=scaling)
    assert is_svg(out)
    # the SVG is reproducible: no date, fixed ids
    assert out.read_bytes() == save_plot(e, tmp_path / "e2.svg", scaling=scaling).read_bytes()
    # without sweeps the renderer computes none: the panels stay empty
    titles = [ax.get_title() for ax in figure_for(e).axes]
    assert "memory against seq (points, fitted curves dashed)" not in titles


def test_scaling_points_match_the_estimator():
    e = tiny_estimate()
    sweep = scaling_points(e, "seq", [4, 8])
    assert [p["value"] for p in sweep["points"]] == [4, 8]
    assert sweep["points"][0]["peak_bytes"] == e.peak_bytes
    assert sweep["points"][1]["peak_bytes"] == tiny_estimate(seq=8).peak_bytes
    with pytest.raises(SpecError, match="over='heads'"):
        scaling_points(e, "heads", [1])


def test_bad_extension_writes_nothing(tmp_path):
    class Args:
        html = str(tmp_path / "r.html")
        plot = str(tmp_path / "r.pdf")

    with pytest.raises(ConfigError, match=r"unknown extension '\.pdf'; use \.png or \.svg"):
        write_outputs(tiny_estimate(), Args)
    assert list(tmp_path.iterdir()) == []


def test_trace_object_timeline_by_category(tmp_path):
    torch = pytest.importorskip("torch")
    from trainmem.trace import trace

    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    opt = torch.optim.AdamW(model.parameters())
    for _ in range(2):
        with trace(model, opt) as t:
            model(torch.randn(8, 16)).sum().backward()
            opt.step()
            opt.zero_grad()
    fig = figure_for(t.result)
    labels = {text.get_text() for text in fig.axes[0].get_legend().get_texts()}
    assert {"parameter", "activation"} <= labels
    assert save_plot(t.result, tmp_path / "t.png").read_bytes()[:8] == PNG
