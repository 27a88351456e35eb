"""Snapshot pickles are read with an unpickler that admits plain data only (issue 8)."""

from __future__ import annotations

import os
import pickle

import pytest

from trainmem.errors import ConfigError
from trainmem.trace.snapshot_load import load_snapshot, loads_snapshot, summarize_snapshot


class _Evil:
    def __reduce__(self):
        return (os.system, ("echo pwned > /tmp/trainmem-pwned",))


class _Custom:
    pass


@pytest.mark.parametrize("payload", [
    pickle.dumps(_Evil()),
    pickle.dumps({"segments": [], "device_traces": [[_Evil()]]}),
    pickle.dumps({"segments": [_Custom()]}),
    pickle.dumps({"segments": [], "f": print}),
    b"cos\nsystem\n(S'echo pwned'\ntR.",                       # protocol 0 GLOBAL + REDUCE
    b"\x80\x04\x95\x00\x00\x00\x00\x00\x00\x00\x00\x8c\x02os\x8c\x06system\x93.",  # STACK_GLOBAL
], ids=["reduce", "nested-reduce", "class", "builtin", "proto0", "stack-global"])
def test_code_in_a_pickle_is_refused(tmp_path, payload):
    path = tmp_path / "evil.pickle"
    path.write_bytes(payload)
    with pytest.raises(ConfigError, match="refused to load"):
        load_snapshot(path)
    assert not os.path.exists("/tmp/trainmem-pwned")


@pytest.mark.parametrize("payload", [b"", b"\x80", b"not a pickle", pickle.dumps([1, 2])[:-1], pickle.dumps([1, 2]),
                                     pickle.dumps({"no": "segments"}), pickle.dumps({"segments": [], "device_traces": 3}),
                                     b"(" * 200_000 + b"."])
def test_malformed_pickles_are_config_errors(tmp_path, payload):
    path = tmp_path / "bad.pickle"
    path.write_bytes(payload)
    with pytest.raises(ConfigError):
        load_snapshot(path)


def test_missing_and_special_files(tmp_path):
    for p in (tmp_path / "nope.pickle", tmp_path, "/dev/zero"):
        with pytest.raises(ConfigError):
            load_snapshot(p)


def test_our_exported_snapshot_loads_and_summarizes(tmp_path):
    pytest.importorskip("torch")
    from trainmem.specs import ImplSpec, StepSpec
    from trainmem.trace import trace_step
    from trainmem.trace.snapshot import to_memory_snapshot, write_snapshot

    cfg = dict(model_type="llama", hidden_size=64, intermediate_size=176, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=4, vocab_size=1000, max_position_embeddings=256)
    result = trace_step(cfg, StepSpec(batch=2, seq=64, precision="fp32"), ImplSpec())
    path = write_snapshot(result, tmp_path / "t.pickle")
    snap = load_snapshot(path)
    assert snap == pickle.loads(path.read_bytes())
    s = summarize_snapshot(snap, top=5)
    assert s.peak_bytes >= result.peak_bytes  # the allocator rounds block sizes up
    assert s.peak_bytes <= result.peak_reserved_bytes
    assert s.num_segments == len(snap["segments"]) > 0
    assert s.reserved_bytes >= s.allocated_bytes
    assert len(s.top_allocations) == 5 and s.top_allocations[0].size_bytes >= s.top_allocations[-1].size_bytes
    for expandable in (True,):
        assert loads_snapshot(pickle.dumps(to_memory_snapshot(result, expandable_segments=expandable)))


def test_what_torch_pickles_is_admitted():
    """The types torch's own _snapshot() holds: nested dicts and lists of str, int, float, bool,
    None and tuples (segment_pool_id)."""
    snap = {"segments": [{"device": 0, "address": 1 << 40, "total_size": 2 << 20, "segment_pool_id": (0, 0),
                          "is_expandable": False, "frames": [], "blocks": [
                              {"address": 1 << 40, "size": 512, "requested_size": 500, "state": "active_allocated",
                               "frames": [{"filename": "x.py", "line": 3, "name": "f"}]}]}],
            "device_traces": [[{"action": "alloc", "addr": 1 << 40, "size": 512, "stream": 0, "time_us": 1.5,
                                "frames": [{"filename": "x.py", "line": 3, "name": "f"}]}]],
            "allocator_settings": {"PYTORCH_CUDA_ALLOC_CONF": None, "max_split_size": -1}}
    for protocol in range(pickle.HIGHEST_PROTOCOL + 1):
        s = summarize_snapshot(loads_snapshot(pickle.dumps(snap, protocol=protocol)))
        assert (s.peak_bytes, s.allocated_bytes, s.reserved_bytes) == (512, 512, 2 << 20)
        assert s.top_allocations[0].where == "x.py:3 f"
