"""Sliding-window attention: the estimate equals what autograd really saves, to the byte (CPU).

With a window no longer than the sequence, transformers hands SDPA an explicit (B, 1, S, S) mask
(``masking_utils._ignore_causal_mask_sdpa``), so K and V are repeated to every head rather than
passed with ``enable_gqa`` and SDPA's additive copy of the mask is kept by every layer. A window
longer than the sequence changes nothing. Real models from config, saved-tensor hooks.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from trainmem.specs.loaders import spec_from_hf_config

from kinds_configs import B, S, check_against_autograd
SMALL = dict(hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=500)
CONFIGS = {
    "mistral": dict(model_type="mistral", **SMALL),
    # Gemma-2: local (sliding) and global blocks alternate
    "gemma2": dict(model_type="gemma2", head_dim=16, **SMALL),
    "phi3": dict(model_type="phi3", pad_token_id=0, **SMALL),  # fused qkv_proj: K and V are views of its output
    # Qwen2/Qwen3: blocks from max_window_layers on slide, only with use_sliding_window
    "qwen2": dict(model_type="qwen2", use_sliding_window=True, max_window_layers=1, **SMALL),
    "qwen3": dict(model_type="qwen3", use_sliding_window=True, max_window_layers=1, head_dim=16, **SMALL),
}


SLOW = pytest.mark.slow  # each case builds and runs a model: a few by default, the rest slow


@pytest.mark.parametrize("attention,precision", [
    ("sdpa", "fp32"), ("sdpa", "bf16"), pytest.param("sdpa", "amp-bf16", marks=SLOW),
    pytest.param("eager", "fp32", marks=SLOW), pytest.param("eager", "bf16", marks=SLOW),
    pytest.param("eager", "amp-bf16", marks=SLOW)])
def test_mistral_window_shorter_than_sequence(precision, attention):
    items = check_against_autograd({**CONFIGS["mistral"], "sliding_window": 16}, precision, attention)
    masks = [i for i in items if i.name.endswith("attn_mask")]
    assert len(masks) == (2 if attention == "sdpa" else 0)
    if masks:  # SDPA's additive mask in the query's dtype, one per layer
        assert masks[0].shape == (B, 1, S, S)


@pytest.mark.parametrize("window,masked", [(S, True), pytest.param(S + 1, False, marks=SLOW)])
def test_mistral_window_edge(window, masked):
    # a mask from window == S on (kv_length >= local_attention_size), none past it
    items = check_against_autograd({**CONFIGS["mistral"], "sliding_window": window}, "fp32", "sdpa")
    assert any(i.name.endswith("attn_mask") for i in items) is masked


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_mistral_window_math_kernel_with_dropout(precision):
    # dropout sends CPU SDPA to the math kernel, which materializes the scores
    check_against_autograd({**CONFIGS["mistral"], "sliding_window": 16, "attention_dropout": 0.1}, precision, "sdpa")


@pytest.mark.slow
def test_mistral_window_full_recompute():
    check_against_autograd({**CONFIGS["mistral"], "sliding_window": 16}, "fp32", "sdpa", "full")


@pytest.mark.parametrize("precision", ["fp32", pytest.param("bf16", marks=SLOW)])
def test_gemma2_local_layers(precision):
    # transformers 5 gives Gemma-2 no SDPA (soft-capping): eager adds either mask and keeps neither
    cfg = {**CONFIGS["gemma2"], "sliding_window": 16}
    spec = spec_from_hf_config(cfg)
    assert [k.attention for k in spec.kinds] == ["sliding", "full"]
    items = check_against_autograd(cfg, precision, "eager")
    assert not [i.name for i in items if i.name.endswith("attn_mask")]


@pytest.mark.parametrize("family,precision", [("phi3", "fp32"), ("qwen3", "bf16")] + [
    pytest.param(f, p, marks=SLOW) for f, p in (("phi3", "bf16"), ("qwen2", "fp32"), ("qwen2", "bf16"),
                                                ("qwen3", "fp32"))])
def test_other_windowed_families(family, precision):
    cfg = {**CONFIGS[family], "sliding_window": 16}
    items = check_against_autograd(cfg, precision, "sdpa")
    masked = [i.name for i in items if i.name.endswith("attn_mask")]
    assert masked == (["model.layers.1.self_attn.attn_mask"] if family != "phi3" else
                      ["model.layers.0.self_attn.attn_mask", "model.layers.1.self_attn.attn_mask"])
    assert not spec_from_hf_config({**cfg, "use_sliding_window": False}).layer_kinds or family == "phi3"
