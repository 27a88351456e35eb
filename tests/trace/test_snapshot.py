"""Snapshot export: the pickle loads back and PyTorch's memory_viz renders it."""

import pickle

import pytest

from tiny_models import LLAMA
from trainmem.specs import ImplSpec, StepSpec
from trainmem.trace import trace_step
from trainmem.trace.snapshot import to_memory_snapshot, write_snapshot


@pytest.fixture(scope="module")
def result():
    return trace_step(LLAMA, StepSpec(batch=2, seq=64, precision="fp32"), ImplSpec())


@pytest.mark.parametrize("expandable", [False, True])
def test_snapshot_round_trip_renders_in_memory_viz(result, tmp_path, expandable):
    from torch.cuda import _memory_viz as viz

    path = write_snapshot(result, tmp_path / "trace.pickle", expandable_segments=expandable)
    data = pickle.loads(path.read_bytes())
    assert set(data) >= {"segments", "device_traces"}
    assert "<html" in viz.trace_plot(data).lower()
    assert "<html" in viz.segment_plot(data).lower()
    text = viz.segsum(data)  # checks that blocks tile every segment exactly
    assert "segments:" in text
    assert viz.trace(data)
    lines = viz.segments(data, format_flamegraph=lambda text: text)  # no flamegraph.pl download
    assert "active_allocated" in lines and viz.memory(data, format_flamegraph=lambda text: text)


def test_snapshot_accounts_like_the_trace(result):
    data = to_memory_snapshot(result)
    live = 0
    peak = 0
    for e in data["device_traces"][0]:
        if e["action"] == "alloc":
            live += e["size"]
            peak = max(peak, live)
        elif e["action"] == "free_completed":
            live -= e["size"]
    assert peak == result.peak_bytes
    reserved = sum(s["total_size"] for s in data["segments"])
    assert reserved == result.peak_reserved_bytes  # segments are never released
