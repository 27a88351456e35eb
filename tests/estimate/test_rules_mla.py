"""Hand-written hf rules for DeepSeek-V2 and V3 (issue 14 items 3-4: MLA attention, dense-then-MoE
blocks, the sigmoid group-limited and the softmax routers): the estimate's activations equal
autograd's saved set to the byte on tiny configs (CPU; fp32, bf16, amp-bf16; SDPA and eager), and
equal ``--profile traced`` (which also runs V2's complex64 rotary table on fake tensors)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from trainmem.errors import UnsupportedError  # noqa: E402
from trainmem.estimate.activations import activation_items  # noqa: E402
from trainmem.specs import ImplSpec, StepSpec  # noqa: E402
from trainmem.specs.loaders import spec_from_hf_config  # noqa: E402

from kinds_configs import check_against_autograd, check_against_traced  # noqa: E402

# num_key_value_heads: DeepseekV3Config defaults it to 128, and eager attention's repeat_kv then
# repeats each of the 4 heads 4 // 128 = 0 times
_BASE = dict(hidden_size=128, num_attention_heads=4, num_key_value_heads=4, vocab_size=500, intermediate_size=256,
             moe_intermediate_size=32, n_routed_experts=8, num_experts_per_tok=2, kv_lora_rank=32,
             qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16)
CONFIGS = {
    # q_lora, one dense block then MoE, 4 groups of 2 experts, 2 groups picked, renormalized top-k
    "v3": dict(model_type="deepseek_v3", num_hidden_layers=3, first_k_dense_replace=1, q_lora_rank=48,
               n_shared_experts=1, n_group=4, topk_group=2, **_BASE),
    # no q_lora (one q_proj), no renormalization, the half-rotated rope layout
    "v3_plain": dict(model_type="deepseek_v3", num_hidden_layers=2, first_k_dense_replace=1, q_lora_rank=None,
                     n_shared_experts=2, n_group=1, topk_group=1, norm_topk_prob=False, rope_interleave=False,
                     **_BASE),
    # complex64 rotary, softmax greedy router, two shared experts
    "v2": dict(model_type="deepseek_v2", num_hidden_layers=3, first_k_dense_replace=1, q_lora_rank=None,
               n_shared_experts=2, **_BASE),
    # q_lora and the group-limited greedy router (its masked scores keep a (B·S, E) bool mask)
    "v2_group": dict(model_type="deepseek_v2", num_hidden_layers=2, first_k_dense_replace=1, q_lora_rank=48,
                     n_shared_experts=1, topk_method="group_limited_greedy", n_group=4, topk_group=2, **_BASE),
}


def test_reader_picks_each_router():
    v3, v2, v2g = (spec_from_hf_config(CONFIGS[n]) for n in ("v3", "v2", "v2_group"))
    assert (v3.router_norm_topk, v3.router_group_mask) == (True, False)
    assert (v2.router_norm_topk, v2.router_group_mask) == (False, False)  # DeepseekV2TopkRouter never renormalizes
    assert (v2g.router_norm_topk, v2g.router_group_mask) == (False, True)
    assert [k.label for k in v3.kinds] == ["full", "full+moe", "full+moe"]
    with pytest.raises(UnsupportedError, match="topk_method='noaux'"):
        spec_from_hf_config({**CONFIGS["v2"], "topk_method": "noaux"})


def test_math_kernel_tensors_per_head_axis():
    # q/k heads are nope + rope = 24 wide, v heads 16: SDPA's CPU math kernel keeps the scaled q and
    # kᵀ at 24, the softmax at S, and v at 16 dims per head (fp32 in a bf16 model); o_proj keeps its
    # (B, S, A·16) bf16 input
    B, S = 2, 32
    items = activation_items(spec_from_hf_config(CONFIGS["v3"]), StepSpec(batch=B, seq=S, precision="bf16"),
                             ImplSpec(attention="sdpa", device="cpu"))
    core = {i.name.rsplit(".", 1)[1]: i.bytes for i in items if i.name.startswith("model.layers.1.self_attn.")
            and "proj" not in i.name and "layernorm" not in i.name}
    assert core == {"q_scaled": B * 4 * S * 24 * 4, "k_t_scaled": B * 4 * S * 24 * 4,
                    "softmax": B * 4 * S * S * 4, "v_bmm": B * 4 * S * 16 * 4, "attn_out": B * S * 4 * 16 * 2}


def test_refuses_what_it_does_not_model_in_one_line():
    spec = spec_from_hf_config(CONFIGS["v3"])
    for impl in (ImplSpec(attention="sdpa-math", device="cuda"), ImplSpec(attention="sdpa", device="cpu",
                                                                      recompute="op")):
        with pytest.raises(UnsupportedError) as exc:
            activation_items(spec, StepSpec(batch=1, seq=16), impl)
        assert "--profile traced" in str(exc.value) and "\n" not in str(exc.value)


# a real model's forward takes 5-25 s on the shared CPUs: all slow
@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(CONFIGS))
@pytest.mark.parametrize("precision", ["fp32", "bf16", "amp-bf16"])
@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_activations_equal_autograd(name, precision, attention):
    check_against_autograd(CONFIGS[name], precision, attention)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["v3", "v2"])
def test_full_recompute_equals_autograd(name):
    check_against_autograd(CONFIGS[name], "bf16", "sdpa", recompute="full")


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(CONFIGS))
@pytest.mark.parametrize("precision,attention", [("fp32", "sdpa"), ("bf16", "sdpa"), ("bf16", "eager")])
def test_hf_rules_equal_the_traced_profile(tmp_path, monkeypatch, name, precision, attention):
    monkeypatch.setenv("TRAINMEM_CACHE", str(tmp_path / "cache"))
    check_against_traced(CONFIGS[name], tmp_path, precision, attention)
