"""MoE shared experts keep activations (issue 12, item 8b).

transformers' DeepSeek MoE (``modeling_deepseek_v3.py``, ``DeepseekV3MoE``) adds
``shared_experts(input)`` -- one ``DeepseekV3MLP`` as wide as all shared experts together -- to the
routed output; the parameter layout (``estimate/params.py``) already counts that MLP.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from trainmem.estimate.activations import activation_items
from trainmem.specs import ImplSpec, ModelSpec, StepSpec

B, S, H, ES, FE = 2, 32, 64, 2, 48
MOE = ModelSpec(family="mixtral", hidden_size=H, num_layers=2, num_heads=4, num_kv_heads=2, ffn_size=176,
                vocab_size=500, num_experts=4, top_k=2, expert_ffn_size=FE, num_shared_experts=ES)
SHARED = "model.layers.0.mlp.shared_experts."


def _items(model, precision="fp32", device="cuda"):
    return activation_items(model, StepSpec(batch=B, seq=S, precision=precision), ImplSpec(device=device))


def test_shared_experts_keep_what_a_dense_mlp_of_their_width_keeps():
    shared = {i.name[len(SHARED):]: i.bytes for i in _items(MOE) if i.name.startswith(SHARED)}
    dense = replace(MOE, num_experts=0, top_k=0, expert_ffn_size=0, num_shared_experts=0, ffn_size=ES * FE)
    mlp = "model.layers.0.mlp."
    expected = {i.name[len(mlp):]: i.bytes for i in _items(dense) if i.name.startswith(mlp)}
    assert shared == expected
    # fp32: gate and up outputs, act(gate), act·up (down's input): 4 · B·S·Es·Fe · 4 bytes
    assert sum(shared.values()) == 4 * (2 * 32 * 2 * 48) * 4 == 98304
    # and nothing else changes: the routed experts keep the same with or without shared ones
    without = replace(MOE, num_shared_experts=0)
    assert sum(i.bytes for i in _items(MOE)) - sum(i.bytes for i in _items(without)) == 2 * 98304  # two layers


def test_shared_experts_formulas_name_their_width():
    items = {i.name: i for i in _items(MOE)}
    up = items[SHARED + "up_proj.out"]
    assert up.dims == ("B", "S", "Es·Fe") and up.formula == "B·S·Es·Fe·4"


@pytest.mark.parametrize("precision", ["fp32", "amp-bf16"])
def test_shared_experts_match_what_pytorch_saves(precision):
    """Ground truth: transformers' DeepseekV3MLP of width Es·Fe (the shared_experts module), with
    saved-tensor hooks on CPU."""
    torch = pytest.importorskip("torch")
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MLP

    from trainmem.trace.saved import saved_tensors

    cfg = DeepseekV3Config(hidden_size=H, intermediate_size=176, moe_intermediate_size=FE, n_shared_experts=ES,
                           hidden_act="silu")
    mlp = DeepseekV3MLP(cfg, intermediate_size=cfg.moe_intermediate_size * cfg.n_shared_experts)
    # a non-leaf input, as in the model: autocast caches the casts of leaves only
    x = torch.randn(B, S, H, requires_grad=True) * 1.0

    def forward():
        if precision == "amp-bf16":
            with torch.autocast("cpu", dtype=torch.bfloat16):
                return mlp(x)
        return mlp(x)

    saved, _ = saved_tensors(mlp, forward)
    # in fp32 the projections keep x itself: in the block that is the router's input, counted there
    measured = sum(s.nbytes for s in saved) - (x.untyped_storage().nbytes() if precision == "fp32" else 0)
    estimated = sum(i.bytes for i in _items(MOE, precision, "cpu") if i.name.startswith(SHARED))
    assert estimated == measured
