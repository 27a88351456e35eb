"""A checkpointed compiled Gemma block's backward moments (``--compile`` per block, ``--recompute full``,
``estimate/compiled_recompute.py`` ``_ACTIVATIONS`` and ``unit_offset_norm``): GELU-tanh's recomputed values
and GemmaRMSNorm's fp32 normalized product, against the Llama-style (SiLU) counts on the same inventory."""

import pytest

from trainmem.estimate.activations import activation_inventory
from trainmem.estimate.compiled_recompute import block_math, compiled_checkpoint_moments
from trainmem.specs import ImplSpec, StepSpec
from trainmem.specs.loaders import spec_from_hf_config

GEMMA = dict(model_type="gemma", hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=1, head_dim=16, vocab_size=128, max_position_embeddings=256,
             tie_word_embeddings=True)  # MQA and a tied head, as Gemma-2B
STEP = StepSpec(batch=2, seq=64, precision="bf16", optimizer="adamw")


def test_gemma_gelu_tanh_and_unit_offset_norm_hold_more():
    # tiny Gemma B 2 S 64 bf16: its GELU-tanh recompute holds four fp32 B·S·F values (x/2, the tanh's input,
    # tanh, 1 + tanh) where SiLU holds the gate's fp32 copy, and its backward writes two at once, not three:
    # +3 x 90112 at the product's moment, (4 - 1) x 90112 - 90112 = +2 x 90112 at the activation's; each
    # GemmaRMSNorm holds its normalized product in fp32 (B·S·H·4, not ·2) and its fp32 1 + weight (H·4):
    # 2 x (16384 + 256) = +33280 at both
    m = spec_from_hf_config(GEMMA)
    plain = activation_inventory(m, STEP, ImplSpec(device="cpu", attention="sdpa", compile=True, compile_scope="block"))
    acts = activation_inventory(m, STEP, ImplSpec(device="cpu", attention="sdpa", compile=True, compile_scope="block",
                                                  recompute="full"))
    assert block_math(m) == {"activation": "geglu", "unit_offset_norm": True, "eager_set": False,
                             "uncheckpointed": True, "one_graph": False}
    gemma = compiled_checkpoint_moments(acts, 0, 16384, plain, **block_math(m))
    llama = compiled_checkpoint_moments(acts, 0, 16384, plain)
    assert [g["work"] - w["work"] for g, w in zip(gemma, llama)] == [3 * 90112 + 33280, 2 * 90112 + 33280]
    assert compiled_checkpoint_moments(acts, 0, 16384, plain, activation="relu") == []


def test_gemma_peaks_at_gelu_backward():
    # the whole step, == the trace's peak to the byte (bf16 0.859, fp32 0.890 with SiLU's counts)
    from trainmem.estimate import estimate

    full = ImplSpec(device="cpu", attention="sdpa", compile=True, compile_scope="block", recompute="full")
    for precision, peak in (("bf16", 1516362), ("fp32", 2458700)):
        e = estimate(spec_from_hf_config(GEMMA), StepSpec(batch=2, seq=64, precision=precision, optimizer="adamw"), full)
        assert (e.peak_bytes, e.peak.name) == (peak, "backward_first_block")


@pytest.mark.slow  # one compiled trace, 15 s measured on 2 shared cores
def test_gemma_estimate_peak_equals_the_compiled_trace():
    from trainmem.estimate import estimate
    from trainmem.trace import trace_step

    full = ImplSpec(device="cpu", attention="sdpa", compile=True, compile_scope="block", recompute="full")
    e = estimate(spec_from_hf_config(GEMMA), STEP, full)
    assert e.peak_bytes == trace_step(GEMMA, STEP, full).peak_logical_bytes  # 1516362
