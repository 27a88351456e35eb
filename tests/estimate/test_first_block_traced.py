"""The first block's backward (phase ``backward_first_block``) under ``--profile traced``: the gated
MLP's product moment (estimate/block_backward.py ``_gated_mlp``) now recognises the trace's item
names (``mlp.gate_proj.mm``, ``act_fn.silu``, ``up_proj.mm``, ``mul``, then the block's ``add_N``), as
it did the hf rules' (``gate_proj.out`` ... ``act_mul_up``, ``residual_mlp``). Before, the traced
phase fell back to the block working set, 73,736 B under (tiny Llama fp32 eager, 3 blocks, B=2, S=32).

Measured: the live bytes of a real CPU step (``trace_step(..., real=True)``, the recorder's events
summed by logical bytes over the allocations made in ``model.layers.0``'s backward) top out at
3,463,752 B, in ``model.layers.0.mlp``'s ``mul`` backward: the hf phase to the byte, and now the
traced one too. The tie to the real step is tests/estimate/test_norm_backward_peak.py's (estimate
== trace where that moment is the peak); here the two profiles are held equal phase by phase."""

from __future__ import annotations

import json

import pytest

CFG = dict(model_type="llama", hidden_size=64, intermediate_size=176, num_hidden_layers=3,
           num_attention_heads=4, num_key_value_heads=2, vocab_size=500)


@pytest.mark.slow  # one trace: ~5-10 s on 2 shared cores
@pytest.mark.usefixtures("traced_cache")
@pytest.mark.parametrize("model_type, precision, attention", [
    ("llama", "fp32", "eager"), ("qwen2", "bf16", "sdpa")])
def test_traced_first_block_backward_equals_hf(tmp_path, model_type, precision, attention):
    from trainmem.estimate import estimate
    from trainmem.specs import ImplSpec, StepSpec
    from trainmem.specs.loaders import load_model
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**CFG, "model_type": model_type}))
    traced, ruled = (estimate(load_model(str(path)), StepSpec(batch=2, seq=32, precision=precision),
                              ImplSpec(profile=p, device="cpu", attention=attention)) for p in ("traced", "hf"))
    assert [(p.name, p.bytes) for p in traced.phases] == [(p.name, p.bytes) for p in ruled.phases]
    first = {p.name: p for p in traced.phases}["backward_first_block"]
    if precision == "fp32":  # the MLP product's moment, measured on a real step (docstring)
        assert first.bytes == 3_463_752 and "MLP product" in first.note
