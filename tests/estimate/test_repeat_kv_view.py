"""transformers' ``repeat_kv`` (modeling_mistral.py / modeling_llama.py) copies K and V only when a
KV head serves several query heads AND there is more than one KV head: with ``n_rep == 1`` it
returns its input, and with ONE KV head ``expand(B, 1, n_rep, S, hd).reshape(B, n_rep, S, hd)`` is a
view (PyTorch merges the size-1 dim). SDPA with a materialized window mask (no ``enable_gqa``) then
keeps k and v themselves. The hf rules (estimate/attention.py ``attention_core``) count the copies
only in the middle case; checked on real tensors here, against the trace (one device) below and
against a real tp = 2 run (one KV head per rank) in tests/parallel/test_traced_tp_dist.py."""

from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")

SMALL = dict(hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=4,
             vocab_size=500, sliding_window=16)


def _repeat_kv(x, n_rep):  # modeling_mistral.repeat_kv's ops (importing the module costs ~8 s)
    if n_rep == 1:
        return x
    b, kv, s, hd = x.shape
    return x[:, :, None, :, :].expand(b, kv, n_rep, s, hd).reshape(b, kv * n_rep, s, hd)


def test_repeat_kv_is_a_view_with_one_kv_head_and_a_copy_with_two():
    repeat_kv = _repeat_kv
    k1 = torch.randn(2, 32, 1, 16).transpose(1, 2)  # k_proj's output split into heads, as the model does
    assert repeat_kv(k1, 4).untyped_storage().data_ptr() == k1.untyped_storage().data_ptr()
    k2 = torch.randn(2, 32, 2, 16).transpose(1, 2)
    assert repeat_kv(k2, 2).untyped_storage().data_ptr() != k2.untyped_storage().data_ptr()
    assert repeat_kv(k2, 1) is k2


def _estimate(tmp_path, kv, profile):
    from trainmem.estimate import estimate
    from trainmem.specs import ImplSpec, StepSpec
    from trainmem.specs.loaders import load_model
    path = tmp_path / "config.json"
    path.write_text(json.dumps(dict(model_type="mistral", num_key_value_heads=kv, **SMALL)))
    return estimate(load_model(str(path)), StepSpec(batch=2, seq=32, precision="fp32"),
                    ImplSpec(profile=profile, device="cpu", attention="sdpa"))


@pytest.mark.parametrize("kv, copies", [(1, 0), (2, 4), (4, 0)])
def test_hf_rules_count_repeat_copies_only_for_several_kv_heads(tmp_path, kv, copies):
    rep = [i for i in _estimate(tmp_path, kv, "hf").inventory.items if i.name.endswith("_repeat")]
    assert len(rep) == copies  # k_repeat and v_repeat per layer, 2 layers
    assert all(i.bytes == 2 * 4 * 32 * 16 * 4 for i in rep)  # (B, A, S, hd) fp32


@pytest.mark.slow  # one trace: a few seconds
@pytest.mark.usefixtures("traced_cache")
def test_one_kv_head_hf_equals_the_trace(tmp_path):
    ruled, traced = _estimate(tmp_path, 1, "hf"), _estimate(tmp_path, 1, "traced")
    assert ruled.totals_bytes == traced.totals_bytes
