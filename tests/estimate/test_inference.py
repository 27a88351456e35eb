"""Inference memory: exact KV-cache integers, paging, prefill peak without autograd."""

from __future__ import annotations

import pytest

from trainmem.errors import SpecError
from trainmem.estimate import estimate
from trainmem.estimate.inference import inference_estimate, kv_cache_bytes
from trainmem.inventory import Category
from trainmem.specs import ImplSpec, StepSpec
from trainmem.specs.loaders import load_model


def test_llama2_7b_kv_cache_is_2_gib():
    m = load_model("llama-2-7b")
    e = inference_estimate(m, StepSpec(batch=1, seq=4096, precision="fp16"), context=4096)
    # 2 · 32 layers · 4096 tokens · 32 kv heads · 128 · 2 bytes = 2 GiB
    assert e.totals_bytes["kv_cache"] == 2 * 32 * 4096 * 32 * 128 * 2 == 2 << 30


def test_llama3_8b_gqa_kv_cache_is_512_mib():
    m = load_model("llama-3-8b")
    e = inference_estimate(m, StepSpec(batch=1, seq=4096, precision="bf16"), context=4096)
    # 8 kv heads: 2 · 32 · 4096 · 8 · 128 · 2 = 512 MiB
    assert e.totals_bytes["kv_cache"] == 2 * 32 * 4096 * 8 * 128 * 2 == 512 << 20


def test_paged_blocks_round_the_context_up():
    m = load_model("llama-3-8b")
    # context 1000 in blocks of 16 -> 1008 tokens; batch 3
    assert kv_cache_bytes(m, batch=3, context=1000, block_size=16) == 2 * 32 * 3 * 1008 * 8 * 128 * 2
    e = inference_estimate(m, StepSpec(batch=3, seq=512), context=1000, block_size=16)
    assert e.totals_bytes["kv_cache"] == 2 * 32 * 3 * 1008 * 8 * 128 * 2
    e1 = inference_estimate(m, StepSpec(batch=3, seq=512), context=1000, block_size=1)
    assert e1.totals_bytes["kv_cache"] == 2 * 32 * 3 * 1000 * 8 * 128 * 2


def test_inference_has_weights_and_cache_only():
    m = load_model("gpt2")
    step = StepSpec(batch=2, seq=1024, precision="bf16")
    e = inference_estimate(m, step, context=1024)
    train = estimate(m, step, ImplSpec())
    t = e.totals_bytes
    assert t["parameter"] == train.totals_bytes["parameter"]
    assert t["gradient"] == t["optimizer_state"] == t["activation"] == 0
    assert {i.category for i in e.inventory} == {Category.PARAMETER, Category.KV_CACHE}
    # prefill holds one block's working set, far below training's saved activations
    prefill = next(p for p in e.phases if p.name == "prefill")
    assert prefill.parts["block_live"] < train.totals_bytes["activation"] / m.num_layers
    assert e.peak_bytes == max(p.bytes for p in e.phases) < train.peak_bytes


def test_bad_context():
    m = load_model("gpt2")
    with pytest.raises(SpecError, match="context"):
        inference_estimate(m, StepSpec(batch=1, seq=1024), context=512)
    with pytest.raises(SpecError, match="block_size"):
        inference_estimate(m, StepSpec(batch=1, seq=512), context=512, block_size=0)
