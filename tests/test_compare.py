"""Estimate vs trace for every supported model family (issue #3): activations and peak within 3%.

The trace runs the real HF model on fake CPU tensors (real tensors for MoE, whose routing is
data-dependent); the estimate models CPU kernels (device='cpu') to compare like with like.
Remaining per-module differences are explained in docs/compare.md.
"""

from __future__ import annotations

import json

import pytest

pytest.importorskip("torch")

from trainmem.cli import main
from trainmem.compare import compare
from trainmem.estimate import estimate
from trainmem.specs import ImplSpec, StepSpec
from trainmem.specs.loaders import spec_from_hf_config
from trainmem.trace import trace_step

S = dict(hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=4,
         num_key_value_heads=2, vocab_size=500)
FAMILIES = {
    "llama": dict(model_type="llama", **S),
    "mistral": dict(model_type="mistral", **S),
    "qwen2": dict(model_type="qwen2", **S),
    "qwen3": dict(model_type="qwen3", head_dim=16, **S),
    "gemma": dict(model_type="gemma", head_dim=16, **S),
    "gemma2": dict(model_type="gemma2", head_dim=16, **S),
    "phi3": dict(model_type="phi3", pad_token_id=0, **S),
    "mixtral": dict(model_type="mixtral", num_local_experts=4, num_experts_per_tok=2, **S),
    "gpt_neox": dict(model_type="gpt_neox", hidden_size=64, intermediate_size=256, num_hidden_layers=2,
                     num_attention_heads=4, vocab_size=500),
    "gpt2": dict(model_type="gpt2", n_embd=64, n_layer=2, n_head=4, vocab_size=500, n_positions=64),
    "bert": dict(model_type="bert", hidden_size=64, intermediate_size=256, num_hidden_layers=2,
                 num_attention_heads=4, vocab_size=500, max_position_embeddings=64),
}
CASES = [(f, p, a, r) for f in FAMILIES
         for p, a, r in (("bf16", "sdpa", "none"), ("amp-bf16", "eager", "none"), ("fp32", "sdpa", "full"),
                         ("bf16", "eager", "selective"))
         if not (f == "gemma2" and a == "sdpa")]  # transformers runs Gemma-2 (soft-capping) eager only


@pytest.mark.parametrize("family,precision,attention,recompute", CASES)
def test_estimate_agrees_with_trace(family, precision, attention, recompute):
    cfg = FAMILIES[family]
    step = StepSpec(batch=2, seq=32, precision=precision)
    # foreach AdamW, as these cases were measured: its temporaries make the optimizer step the peak
    # where backward would otherwise be (see test_for_loop_optimizer_peak_in_backward)
    impl = ImplSpec(attention=attention, recompute=recompute, device="cpu", optimizer_impl="foreach")
    c = compare(estimate(spec_from_hf_config(cfg), step, impl),
                trace_step(cfg, step, impl, real=family == "mixtral"))
    d = c.to_dict()
    off = [(r.name, r.estimate_bytes, r.trace_bytes) for r in c.rows if r.estimate_bytes != r.trace_bytes]
    assert abs(d["activations"]["ratio"] - 1) <= 0.03, off
    assert abs(d["peak"]["ratio"] - 1) <= 0.03, (c.estimate_peak_phase, c.trace_peak_phase)


@pytest.mark.parametrize("family", ["gpt2", "gemma"])
def test_for_loop_optimizer_peak_in_backward(family):
    """torch's CPU default steps AdamW one tensor at a time, so under full recompute the peak moves
    into backward: the first block's backward, which runs last with every later gradient alive
    (phase backward_first_block; before it existed the estimate missed these by 12%). The block's
    gradient working set is approximated by its output gradient and its largest tensor's gradient:
    on these 2-layer toys that leaves the estimate 3-4% low (gpt2 0.970, gemma 0.969, measured)."""
    cfg = FAMILIES[family]
    step = StepSpec(batch=2, seq=32, precision="fp32")
    impl = ImplSpec(attention="sdpa", recompute="full", device="cpu", optimizer_impl="for-loop")
    e = estimate(spec_from_hf_config(cfg), step, impl)
    t = trace_step(cfg, step, impl)
    assert t.peak_phase == "backward"
    ratio = e.peak_bytes / t.peak_logical_bytes
    assert 0.96 <= ratio <= 1.0, ratio
    first = next(p for p in e.phases if p.name == "backward_first_block")
    last = next(p for p in e.phases if p.name == "backward")
    assert first.bytes > last.bytes  # every later gradient exists by then


@pytest.mark.slow  # ~6 s on CI's two cores: GPT-2 traced
def test_compare_cli_json(capsys):
    assert main(["compare", "--model", "gpt2", "--batch", "1", "--seq", "64", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["schema"] == "trainmem.compare/2"
    assert {"name", "estimate_bytes", "trace_bytes", "ratio"} <= set(data["rows"][0])
    assert abs(data["peak"]["ratio"] - 1) < 0.03 and abs(data["activations"]["ratio"] - 1) < 0.03
