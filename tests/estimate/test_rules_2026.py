"""Hand-written hf rules for the 2026 families (issue 14 item 4): the estimate's activations equal
autograd's saved set to the byte on tiny configs (CPU), and equal ``--profile traced``."""

from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")

from trainmem.estimate import estimate  # noqa: E402
from trainmem.specs import ImplSpec, StepSpec  # noqa: E402
from trainmem.specs.loaders import load_model, spec_from_hf_config  # noqa: E402
from trainmem.estimate.params import parameter_shapes  # noqa: E402

from kinds_configs import TINY, check_against_autograd  # noqa: E402
from test_layer_kinds import _meta_parameters  # noqa: E402

CONFIGS = {
    # dense blocks 0 and 3 (mlp_only_layers), MoE elsewhere; renormalized top-k
    "qwen3_moe": dict(model_type="qwen3_moe", intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=5,
                      num_key_value_heads=2, head_dim=16, num_experts=4, num_experts_per_tok=2,
                      mlp_only_layers=[0, 3], norm_topk_prob=True, **TINY),
    # every second block MoE (decoder_sparse_step), the config class's norm_topk_prob=False
    "qwen3_moe_step": dict(model_type="qwen3_moe", intermediate_size=128, moe_intermediate_size=32,
                           num_hidden_layers=4, num_key_value_heads=2, head_dim=16, num_experts=4,
                           num_experts_per_tok=2, decoder_sparse_step=2, **TINY),
    "olmo2": dict(model_type="olmo2", intermediate_size=128, num_hidden_layers=3, num_key_value_heads=2, **TINY),
}
KINDS = {"qwen3_moe": ["full", "full+moe", "full+moe", "full", "full+moe"],
         "qwen3_moe_step": ["full", "full+moe", "full", "full+moe"], "olmo2": ["full"] * 3}



@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_kinds_and_parameters_equal_the_real_model(name):
    spec = spec_from_hf_config(CONFIGS[name])
    assert [k.label for k in spec.kinds] == KINDS[name]
    assert parameter_shapes(spec) == _meta_parameters(CONFIGS[name])


DEFAULT = (("qwen3_moe", "bf16", "sdpa"), ("qwen3_moe_step", "fp32", "eager"), ("olmo2", "bf16", "sdpa"))
CASES = list(DEFAULT) + [
    pytest.param(n, p, a, marks=pytest.mark.slow) for n in CONFIGS for p in ("fp32", "bf16", "amp-bf16")
    for a in ("sdpa", "eager") if (n, p, a) not in DEFAULT]


@pytest.mark.parametrize("name,precision,attention", CASES)
def test_activations_equal_autograd(name, precision, attention):
    check_against_autograd(CONFIGS[name], precision, attention)


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(CONFIGS))
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_hf_rules_equal_the_traced_profile(tmp_path, monkeypatch, name, precision):
    monkeypatch.setenv("TRAINMEM_CACHE", str(tmp_path / "cache"))
    path = tmp_path / "config.json"
    path.write_text(json.dumps(CONFIGS[name]))
    model, step = load_model(str(path)), StepSpec(batch=2, seq=32, precision=precision)
    traced = estimate(model, step, ImplSpec(profile="traced", device="cpu", attention="sdpa"))
    ruled = estimate(model, step, ImplSpec(profile="hf", device="cpu", attention="sdpa"))
    assert traced.totals_bytes == ruled.totals_bytes
    assert traced.peak_bytes == ruled.peak_bytes
