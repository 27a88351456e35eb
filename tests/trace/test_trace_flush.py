"""``trainmem trace --gpu`` in three states: the trace's own recorded stream replayed with the
caching allocator's release-and-retry (trace/flush.py, estimate/allocation_order.py
``replay_events_with_flush``; c10/cuda/CUDACachingAllocator.cpp ``DeviceCachingAllocator::malloc``
→ ``release_cached_blocks`` → ``alloc_block`` again).

Llama h128/L2/V16000, bf16 AdamW (foreach), B=2, S=256, traced on fake tensors (torch 2.13.0+cpu):
allocated peak 131,812,864 B, reserved peak of an unlimited device 155,189,248 B. Replayed at a
capacity, the step runs from 153,092,096 B of reserved memory on: one failed cudaMalloc per step
frees 64 MiB of wholly free cached segments (67,108,864 B), and the reserved peak with that flush is
153,092,096 B. One byte less and a cudaMalloc fails even after the release.
"""

import json
from dataclasses import replace

import pytest

from trainmem.cli import main
from trainmem.specs import ImplSpec, StepSpec
from trainmem.trace import trace_step
from trainmem.trace.allocator import replay
from trainmem.trace.flush import UNREPLAYED, trace_events, trace_fit_state

CFG = {"model_type": "llama", "hidden_size": 128, "intermediate_size": 344, "num_hidden_layers": 2,
       "num_attention_heads": 4, "num_key_value_heads": 4, "vocab_size": 16000, "max_position_embeddings": 2048}
STEP = dict(batch=2, seq=256, precision="bf16")
PEAK, RESERVED, RUNS_FROM = 131_812_864, 155_189_248, 153_092_096
GIB = 1 << 30


@pytest.fixture(scope="module")
def traced():
    return trace_step(CFG, StepSpec(**STEP), ImplSpec())


def test_the_replayed_stream_is_the_reserved_figures(traced):
    assert (traced.peak_bytes, traced.peak_reserved_bytes) == (PEAK, RESERVED)
    assert replay(trace_events(traced.recording)).reserved_peak_bytes == RESERVED


def test_three_states_from_the_traces_own_stream(traced):
    state, flush, why = trace_fit_state(traced, RESERVED)
    assert (state, flush, why) == ("fits", None, "")  # within usable: nothing to replay
    state, flush, _ = trace_fit_state(traced, RESERVED - 1)
    assert state == "fits_with_cache_flush"
    assert (flush.fits, flush.flushes, flush.flushed_bytes, flush.reserved_bytes) == (True, 1, 64 << 20, RUNS_FROM)
    state, flush, _ = trace_fit_state(traced, RUNS_FROM)
    assert state == "fits_with_cache_flush" and flush.reserved_bytes == RUNS_FROM  # exactly full, with the flush
    state, flush, _ = trace_fit_state(traced, RUNS_FROM - 1)
    assert state == "does_not_fit" and flush.fits is False  # replayed, and a cudaMalloc still fails
    state, flush, _ = trace_fit_state(traced, PEAK - 1)
    assert (state, flush) == ("does_not_fit", None)  # the allocated peak alone is over: no replay needed


def test_without_a_stream_to_replay_two_answers_and_why(traced):
    state, flush, why = trace_fit_state(traced, RESERVED - 1, expandable_segments=True)
    assert (state, flush, why) == ("does_not_fit", None, "expandable")
    state, flush, why = trace_fit_state(replace(traced, recording=None), RESERVED - 1)
    assert (state, flush, why) == ("does_not_fit", None, "recording")
    assert set(UNREPLAYED) == {"expandable", "recording"}


@pytest.mark.slow  # ~5 s on the loaded machine: two traces through the CLI
def test_trace_gpu_json_validates_and_text_names_the_figures(tmp_path, capsys):
    from trainmem.schemas import schema_path
    jsonschema = pytest.importorskip("jsonschema")
    (tmp_path / "config.json").write_text(json.dumps(CFG))
    # usable reserved = capacity − the custom preset's 1 GiB context = RESERVED − 1
    argv = ["trace", "--model", str(tmp_path), "--batch", "2", "--seq", "256", "--precision", "bf16",
            "--gpu", "custom", "--gpu-memory", f"{GIB + RESERVED - 1}B"]
    assert main([*argv, "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert not list(jsonschema.Draft202012Validator(json.loads(schema_path("trace").read_text())).iter_errors(d))
    v = d["fits"]
    assert (v["fit_state"], v["fits"], v["flushes"], v["flushed_bytes"], v["flush_reserved_bytes"]) == (
        "fits_with_cache_flush", False, 1, 64 << 20, RUNS_FROM)
    assert (v["allocated_bytes"], v["reserved_bytes"]) == (PEAK, RESERVED)
    assert main([*argv, "--memory-figure", "reserved"]) == 0
    out = capsys.readouterr().out
    assert "FITS ONLY BY FLUSHING THE ALLOCATOR CACHE on 1× custom: needs 148.00 MiB reserved" in out
    assert "reserved peak 146.00 MiB with the flushes" in out  # 153,092,096 B
