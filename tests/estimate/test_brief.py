"""The source brief's own numbers, checked on the estimator's items."""

from __future__ import annotations

from dataclasses import replace

from trainmem.estimate import estimate
from trainmem.estimate.activations import activation_items
from trainmem.estimate.symbols import scaling, symbol_values
from trainmem.specs import ImplSpec, ModelSpec, StepSpec

MiB, GiB = 2**20, 2**30
LLAMA_7B_SHAPE = ModelSpec(family="llama", hidden_size=4096, num_layers=2, num_heads=32, ffn_size=11008,
                           vocab_size=32000)


def _items(model, step, impl):
    return {i.name: i for i in activation_items(model, step, impl)}


def test_bsh_tensor_is_256_mib():
    # 8 × 4096 × 4096 × 2 bytes = 268435456 = 256 MiB
    items = _items(LLAMA_7B_SHAPE, StepSpec(batch=8, seq=4096, precision="bf16"), ImplSpec())
    item = items["model.layers.0.input_layernorm.normed_cast"]
    assert item.shape == (8, 4096, 4096) and item.dtype == "bfloat16"
    assert item.bytes == 8 * 4096 * 4096 * 2 == 256 * MiB
    assert item.formula == "B·S·H·2"


def test_naive_score_matrix_is_2_gib():
    # 2 × 32 × 4096² × 2 bytes = 2 GiB: the bf16 probabilities eager attention hands to P·V
    items = _items(LLAMA_7B_SHAPE, StepSpec(batch=2, seq=4096, precision="bf16"), ImplSpec(attention="eager"))
    probs = items["model.layers.0.self_attn.probs"]
    assert probs.shape == (2, 32, 4096, 4096) and probs.bytes == 2 * GiB
    # HF computes softmax in fp32: 6 bytes per B·A·S² element are saved in all
    assert items["model.layers.0.self_attn.softmax"].bytes == 4 * GiB


def test_flash_attention_saves_no_score_matrix():
    items = _items(LLAMA_7B_SHAPE, StepSpec(batch=2, seq=4096, precision="bf16"), ImplSpec(attention="flash"))
    assert not [n for n, i in items.items() if "S·S" in i.formula]
    assert items["model.layers.0.self_attn.lse"].bytes == 2 * 32 * 4096 * 4  # B·A·S fp32 statistics


def test_doubling_sequence_doubles_linear_terms_and_quadruples_scores():
    step = StepSpec(batch=1, seq=1024, precision="bf16")
    impl = ImplSpec(attention="eager")
    a = _items(LLAMA_7B_SHAPE, step, impl)
    b = _items(LLAMA_7B_SHAPE, replace(step, seq=2048), impl)
    assert a.keys() == b.keys()
    values = symbol_values(LLAMA_7B_SHAPE, step)
    scales = {}
    for name, item in a.items():
        # each axis at 2S over S: S doubles, S·S quadruples, the padded labels' S+1 at B=1 (affine) go to 2S+1
        scales[name] = scale = scaling(item.dims, "S", 2, values)
        assert b[name].bytes == item.bytes * scale, name
        if "S·S" in item.formula:
            assert scale == 4, name
        elif "S" not in item.formula:
            assert scale == 1, name
    assert scales["model.layers.0.self_attn.softmax"] == 4 and scales["model.layers.0.mlp.up_proj.out"] == 2


def test_gradient_accumulation_does_not_raise_activation_peak():
    model = replace(LLAMA_7B_SHAPE, vocab_size=32000)
    one = estimate(model, StepSpec(batch=1, seq=2048, grad_accum=1))
    many = estimate(model, StepSpec(batch=1, seq=2048, grad_accum=8))
    assert one.totals_bytes["activation"] == many.totals_bytes["activation"]
    # gradients persist across micro-batches, so the peak may grow by at most the gradients
    assert many.peak_bytes - one.peak_bytes <= many.totals_bytes["gradient"]


def test_mixed_precision_keeps_fp32_optimizer_state():
    # ZeRO paper accounting: 2 + 2 + 12 bytes per parameter for mixed precision Adam
    e = estimate(LLAMA_7B_SHAPE, StepSpec(precision="mixed-bf16"))
    t = e.totals_bytes
    n = t["parameter"] // 2
    assert (t["parameter"], t["gradient"], t["master_weight"], t["optimizer_state"]) == (2 * n, 2 * n, 4 * n, 8 * n)
