"""Parameters a 16-bit load keeps in fp32 (issue 14): a family's ``fp32_params`` (its model class's
``_keep_in_fp32_modules_strict``; DeepSeek-V2: the router ``gate.weight``, V3 also the
``e_score_correction_bias`` buffer) are fp32 in the parameter ledger, and so are their gradients and
optimizer states, as ``models/hf.build_hf_model`` and transformers' ``from_pretrained`` load them.
Checked against a real bf16 build's ``named_parameters()`` and a trace's ledgers, to the byte."""

from __future__ import annotations

import pytest

from trainmem.estimate.model_states import model_state_items
from trainmem.inventory import Category
from trainmem.specs import StepSpec
from trainmem.specs.loaders import spec_from_hf_config

from test_rules_mla import CONFIGS  # noqa: E402  tiny V3 (q_lora, groups) and V2 (softmax router)


def _ledger(cfg, precision: str) -> dict[str, tuple[str, int]]:
    items = model_state_items(spec_from_hf_config(cfg), StepSpec(batch=1, seq=16, precision=precision))
    return {i.name: (i.dtype, i.bytes) for i in items}


@pytest.mark.parametrize("name", ["v3", "v2"])
def test_router_weight_and_its_states_stay_fp32_in_bf16(name):
    led = _ledger(CONFIGS[name], "bf16")
    gate = "model.layers.1.mlp.gate.weight"  # 8 experts x 128: 1024 values
    for key in (gate, f"{gate}.grad", f"{gate}.exp_avg", f"{gate}.exp_avg_sq"):
        assert led[key] == ("float32", 1024 * 4), key
    # every other parameter stays bf16, its shared experts' gate_proj included
    assert led["model.layers.1.mlp.shared_experts.gate_proj.weight"][0] == "bfloat16"
    assert led["model.layers.0.mlp.gate_proj.weight.grad"][0] == "bfloat16"
    assert sum(1 for k, (dt, _) in led.items() if dt == "float32") == 2 * 4  # two MoE blocks


def test_fp32_and_master_recipes_are_unchanged():
    fp32 = _ledger(CONFIGS["v3"], "fp32")
    assert all(dt == "float32" for dt, _ in fp32.values())
    mixed = _ledger(CONFIGS["v3"], "mixed-bf16")  # fp32 states and masters already; the parameter moves
    gate = "model.layers.2.mlp.gate.weight"
    assert mixed[gate] == ("float32", 4096) and mixed[f"{gate}.exp_avg"] == ("float32", 4096)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["v3", "v2"])
def test_ledger_equals_a_real_bf16_build(name):
    torch = pytest.importorskip("torch")
    from trainmem.models.hf import build_hf_model

    model = build_hf_model(CONFIGS[name], dtype=torch.bfloat16)
    real = {n: p.numel() * p.element_size() for n, p in model.named_parameters()}
    led = _ledger(CONFIGS[name], "bf16")
    assert {n: b for n, (_, b) in led.items() if n in real} == real
    assert len([n for n in led if n.endswith(".grad")]) == len(real)


@pytest.mark.slow
def test_ledgers_equal_the_trace():
    pytest.importorskip("torch")
    from trainmem.estimate import estimate
    from trainmem.specs import ImplSpec
    from trainmem.trace import trace_step

    impl = ImplSpec(attention="sdpa", device="cpu", optimizer_impl="fused")
    step = StepSpec(batch=1, seq=16, precision="bf16")
    t = trace_step(CONFIGS["v3"], step, impl)
    e = estimate(spec_from_hf_config(CONFIGS["v3"]), step, impl)
    for cat in (Category.PARAMETER, Category.GRADIENT, Category.OPTIMIZER_STATE):
        assert sum(i.bytes for i in t.items if i.category is cat) == e.totals_bytes[cat], cat
