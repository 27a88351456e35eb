"""A checkpointed compiled block's backward moment (``--compile --compile-scope block --recompute full``,
``estimate/compiled_recompute.py``): the block's backward graph recomputes its forward and holds what
its backward reads until that read; the step peaks in the MLP's backward. Exact against the trace
(``trace/compiled.py``: inductor's partition run op by op, the same as the real CPU step with that
backend, tests/trace/test_compiled.py); inductor proper fuses and holds less (docs/compile.md).
Under FSDP2: tests/estimate/test_compiled_fsdp.py."""

import pytest

from trainmem.estimate import estimate
from trainmem.specs import ImplSpec, StepSpec
from trainmem.specs.loaders import spec_from_hf_config

LLAMA = dict(model_type="llama", hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=256, max_position_embeddings=256, tie_word_embeddings=False)
FULL = ImplSpec(device="cpu", attention="sdpa", compile=True, compile_scope="block", recompute="full")


def _step(precision):
    return StepSpec(batch=2, seq=64, precision=precision, optimizer="adamw")


def _peak(precision, impl=FULL):
    e = estimate(spec_from_hf_config(LLAMA), _step(precision), impl)
    return e.peak_bytes, e.peak.name


def test_fp32_peaks_at_the_product_backward_of_the_first_block():
    # B=2, S=64, H=64, F=176, 4 heads (2 K/V) of 16, V=256, untied, AdamW, fp32. Resident: parameters
    # 500992, AdamW's two states 1001984, inv_freq and original_inv_freq 64. Gradients made before block
    # 0's backward: lm_head 65536, final norm 256, block 1's 184832; block 0's down_proj 45056: 295680.
    # Kept: ids 1024, eager cos/sin 2 x 4096, block 0's input (the embedding) 32768: 41984.
    # Recomputed and held: two norms' rsqrt 2 x 512, normed product and output 4 x 32768, q 32768,
    # k and v 2 x 16384, SDPA output 32768 and logsumexp 2048, the residual sum 32768, gate, silu(gate)
    # and up 3 x 90112: 535552 (the product act*up was freed by down_proj's weight gradient).
    # Work: the residual stream's gradient 32768, the product's gradient and grad*up 2 x 90112; the
    # loss and its seed gradient 8.
    # 1503040 + 295680 + 41984 + 535552 + 212992 + 8 = 2589256 (the trace's peak, to the byte)
    assert _peak("fp32") == (2589256, "backward_first_block")


def test_bf16_peaks_at_silu_backward_of_the_first_block():
    # bf16: resident 250496 + 500992 + 64; gradients 125312 before block 0, then its down_proj and
    # up_proj 2 x 22528: 170368. Kept: ids 1024, cos/sin 2 x 2048 (the block's bf16 input was freed
    # once the input norm's fp32 copy was made). Recomputed and held: per norm its fp32 input 32768,
    # rsqrt 512, bf16 normed product and output 2 x 16384; q 16384, k and v 2 x 8192, SDPA output 16384
    # and logsumexp 2048; the gate as silu's fp32 copy 90112: 273408. Work: the residual gradient
    # 16384, up_proj's input gradient 16384, silu_backward in fp32 (upcast gradient, sigmoid, their
    # product) 3 x 90112; the loss and its seed gradient 8.
    # 751552 + 170368 + 5120 + 273408 + 303104 + 8 = 1503560 (the trace's peak, to the byte)
    assert _peak("bf16") == (1503560, "backward_first_block")


def test_amp_bf16_peaks_at_silu_backward_with_autocast_copies():
    # amp-bf16 (fp32 weights and residual stream, CPU autocast): resident 500992 + 1001984 + 64; gradients
    # 250624 + down_proj's and up_proj's 2 x 45056 (fp32, cast from the bf16 mm) = 340736. Kept: ids 1024,
    # fp32 cos/sin 2 x 4096, block 0's fp32 input 32768 (the input norm's fp32 input itself): 41984.
    # Recomputed and held: rsqrt 2 x 512, the fp32 normalized products 2 x 32768, the bf16 norm outputs
    # 2 x 16384, q 16384, k, v 2 x 8192, SDPA output 16384, logsumexp 2048, the fp32 residual sum 32768,
    # the bf16 weight copies not yet read by their input-gradient mm (q 8192, k, v 2 x 4096, o 8192,
    # gate 22528), silu's fp32 copy of the gate 90112: 320512. Work: the fp32 residual gradient 32768,
    # up_proj's input gradient cast back to fp32 32768, silu_backward's 3 x 90112; the loss scalars 8.
    # 1503040 + 340736 + 41984 + 320512 + 335880 = 2542152 (the trace's peak, to the byte)
    assert _peak("amp-bf16") == (2542152, "backward_first_block")


def test_whole_model_compile_holds_more_across_its_blocks():
    # one region around both checkpointed blocks (estimate/compiled_recompute.py _one_region_held). Kept: the
    # materialized causal mask B·S·S·4 = 32768 and no eager cos/sin (2·S·hd·4 = 8192): +24576. Held beside
    # block 0's recomputed set: cos and sin, recomputed once, 8192; repeat_kv's K and V at 4 heads instead of
    # k and v at 2, 2·B·S·(A - Akv)·hd·4 = 32768; the rotary backward's zero-filled q- and k-shaped buffers,
    # made in block 1's backward, B·S·(A + Akv)·hd·4 = 49152: +90112.  2589256 + 24576 + 90112 = 2703944
    # bf16: 1503560 + (16384 - 4096) + (4096 + 16384 + 24576) = 1560904 (both the trace's peak, to the byte)
    whole = ImplSpec(device="cpu", attention="sdpa", compile=True, recompute="full")
    assert _peak("fp32", whole) == (2703944, "backward_first_block")
    assert _peak("bf16", whole) == (1560904, "backward_first_block")


def test_other_blocks_keep_the_working_set_alone():
    # an eager recomputed set (compile off) has no compiled moment: the eager rules' stand (block_backward.py)
    from trainmem.estimate.activations import activation_inventory
    from trainmem.estimate.compiled_recompute import compiled_checkpoint_moments

    m = spec_from_hf_config(LLAMA)
    eager = activation_inventory(m, _step("fp32"), ImplSpec(device="cpu", attention="sdpa"))
    compiled = activation_inventory(m, _step("fp32"), ImplSpec(device="cpu", attention="sdpa", compile=True,
                                                                compile_scope="block"))
    assert compiled_checkpoint_moments(compiled, 0, 32768, eager) == []
    assert len(compiled_checkpoint_moments(compiled, 0, 32768, compiled)) == 2
    # not checkpointed: the compiled block's own moments (estimate/compiled_block_moment.py), one in fp32
    assert compiled_checkpoint_moments(compiled, 0, 32768, None) == []  # unless asked (one device)
    assert len(compiled_checkpoint_moments(compiled, 0, 32768, None, uncheckpointed=True)) == 1
    assert compiled_checkpoint_moments(eager, 0, 32768, None, uncheckpointed=True) == []


# another shape: H 128, F 352, 3 blocks, 4/2 heads, V 128 (measured estimate == trace, 3 blocks: fp32 B=2 S=64
# 10,405,000 B, bf16 B=1 S=128 5,638,792 B, fp16 B=2 S=32 5,051,016 B; the working set alone read 0.954, 0.881, 0.983;
# whole-model compile: fp32 B=2 S=64 10,601,608 B, fp16 B=2 S=32 5,096,072 B, and with 4 K/V heads bf16 B=1 S=96
# 5,774,984 B, where the working set alone read 0.937, 0.974, 0.928; amp-bf16 per block B=1 S=96 10,117,256 B, 0.981)
WIDER = dict(LLAMA, hidden_size=128, intermediate_size=352, num_hidden_layers=3, vocab_size=128)


@pytest.mark.slow  # seven compiled traces, ~15-25 s each on 2 shared cores
@pytest.mark.parametrize("config,precision,batch,seq,accum,scope,phase", [
    (LLAMA, "fp32", 2, 64, 1, "block", "backward_first_block"), (LLAMA, "bf16", 2, 64, 1, "block", "backward_first_block"),
    (WIDER, "fp16", 2, 32, 1, "block", "backward_first_block"),
    (LLAMA, "amp-bf16", 2, 64, 1, "block", "backward_first_block"),  # 2542152 (above)
    # two micro-batches: every .grad of the first exists all through the second's backward and the compiled
    # backward returns new weight gradients beside them, so the last block's moment (more activations
    # alive) is the top; measured 1645132 B (fp32: 2872396 B, also == trace)
    (LLAMA, "bf16", 2, 64, 2, "block", "backward"),
    # whole-model compile: 2703944 B (above); without grouped K/V heads q and k share one zero-filled buffer
    (LLAMA, "fp32", 2, 64, 1, "model", "backward_first_block"),
    (dict(WIDER, num_key_value_heads=4), "bf16", 1, 96, 1, "model", "backward_first_block")])
def test_estimate_peak_equals_the_compiled_trace(config, precision, batch, seq, accum, scope, phase):
    from trainmem.trace import trace_step

    step = StepSpec(batch=batch, seq=seq, precision=precision, optimizer="adamw", grad_accum=accum)
    impl = ImplSpec(device="cpu", attention="sdpa", compile=True, compile_scope=scope, recompute="full")
    e = estimate(spec_from_hf_config(config), step, impl)
    # 2589256 fp32, 1503560 bf16 (above), 5051016 fp16 (WIDER)
    assert (e.peak_bytes, e.peak.name) == (trace_step(config, step, impl).peak_logical_bytes, phase)
