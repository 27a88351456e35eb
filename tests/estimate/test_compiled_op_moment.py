"""A block compiled around torchtitan's op-level checkpoint (``--compile --compile-scope block --recompute op``,
``estimate/compiled_op_moment.py``): the partitioner recomputes every ``PREFER_RECOMPUTE`` node, and
``reordering_to_mimic_autograd_engine`` brings each one in when the backward first reads it, so the step peaks in a
block's MLP backward holding what that backward needs of the recompute. Exact against the trace
(``trace/compiled.py``: the partitioned graphs run op by op)."""

import pytest

from trainmem.estimate import estimate
from trainmem.specs import ImplSpec, StepSpec
from trainmem.specs.loaders import spec_from_hf_config

LLAMA = dict(model_type="llama", hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=256, max_position_embeddings=256, tie_word_embeddings=False)
QWEN2 = dict(LLAMA, model_type="qwen2")  # q/k/v biases: three addmm, all saved; then o_proj is the 1st mm, saved


def _impl(recompute="op"):
    return ImplSpec(device="cpu", attention="sdpa", compile=True, compile_scope="block", recompute=recompute)


def _peak(cfg, precision, recompute="op", batch=2, seq=64):
    e = estimate(spec_from_hf_config(cfg), StepSpec(batch=batch, seq=seq, precision=precision, optimizer="adamw"),
                 _impl(recompute))
    return e.peak_bytes, e.peak.name


@pytest.mark.parametrize("precision,peak", [("bf16", 1503560), ("fp32", 2589256)])
def test_llama_op_block_peaks_as_the_fully_checkpointed_block(precision, peak):
    # The policy saves q, v and the gate (the 1st, 3rd, 5th mm; down_proj's, the 7th, is not read), not o_proj's
    # output: the MLP's backward needs the residual sum, so the whole attention is recomputed first and held, as
    # under --recompute full (tests/estimate/test_compiled_recompute.py has the arithmetic). The saved v and gate
    # are the tensors the recompute would make; the saved q is read by the rotary's recompute alone and freed
    # (q_rope is held instead): the same bytes. Both the trace's peak, to the byte (0.923 and 0.968 before).
    assert _peak(LLAMA, precision) == _peak(LLAMA, precision, "full") == (peak, "backward_first_block")


def test_a_saved_o_proj_defers_the_attention_recompute():
    # Qwen2, bf16, B=2, S=64: q/k/v are addmm (saved), o_proj's mm the 1st (saved), gate the 2nd (recomputed), up
    # the 3rd (saved). The last block's SiLU backward (block 1): resident parameters 251008, AdamW 502016, inv_freq
    # 64; gradients lm_head 32768, final norm 128, block 1's down_proj and up_proj 2 x 22528: 77952. Kept: ids 1024,
    # cos/sin 2 x 2048, block 0's input 16384, q/k/v 16384 + 2 x 8192, o 16384, up 45056, its output 16384, block
    # 1's q/k/v 32768: 164864; the loss and its seed 8. Recomputed from block 1's input and its saved o (the
    # attention is not recomputed yet): the post-attention norm's fp32 input 32768, rsqrt 512, normed product and
    # output 2 x 16384, the gate's fp32 copy 90112: 156160. Work: the residual gradient 16384, up_proj's input
    # gradient 16384, silu_backward's 3 x 90112.
    # 831040 + 164864 + 8 + 156160 + 303104 = 1455176 (the trace's peak, to the byte; --recompute full: 1505352)
    assert _peak(QWEN2, "bf16") == (1455176, "backward")


@pytest.mark.slow  # seven compiled traces, ~2-6 s each on 2 shared cores after the first compile
@pytest.mark.parametrize("cfg,precision,batch,seq", [
    (LLAMA, "fp16", 2, 64),
    (dict(LLAMA, num_hidden_layers=3), "bf16", 1, 96),
    (dict(LLAMA, num_key_value_heads=4, vocab_size=128), "fp32", 2, 32),
    (dict(LLAMA, hidden_size=128, intermediate_size=352, num_key_value_heads=1, num_hidden_layers=3), "bf16", 1, 64),
    (QWEN2, "bf16", 2, 64),
    (dict(QWEN2, num_hidden_layers=3), "fp32", 1, 96),
    (QWEN2, "fp32", 2, 64),  # the last block's moment, not its generic working set (1.019 with it)
])
def test_estimate_equals_the_compiled_op_trace(cfg, precision, batch, seq):
    # measured, estimate == trace: 1,503,560 / 1,730,888 / 2,112,072 / 5,096,072 / 1,455,176 / 3,069,128 /
    # 2,527,816 B
    from trainmem.trace import trace_step

    step = StepSpec(batch=batch, seq=seq, precision=precision, optimizer="adamw")
    traced = trace_step(cfg, step, _impl())
    assert estimate(spec_from_hf_config(cfg), step, _impl()).peak_bytes == traced.peak_logical_bytes


FSDP2 = dict(dp=2, fsdp="full")


def _rank(cfg, precision):
    from trainmem.specs import ParallelSpec

    step = StepSpec(batch=2, seq=64, precision=precision, optimizer="adamw")
    (rank,) = estimate(spec_from_hf_config(cfg), step, _impl(), parallel=ParallelSpec(**FSDP2)).ranks
    return rank


@pytest.mark.parametrize("precision,peak", [("fp32", 2325960), ("fsdp-bf16", 1846472), ("bf16", 1371912)])
def test_fsdp2_ranks_run_the_one_device_moment(precision, peak):
    # FSDP2's hooks run outside the compiled block (estimate/compiled_sharded.py), whose backward graph is the
    # one-device one: the same moment beside FSDP2's sharded states and its all-gather / reduce-scatter buffers.
    # The peaks are the FSDP2 trace's, to the byte (test below; 0.855 of it before the moment was modelled)
    rank = _rank(LLAMA, precision)
    assert rank.peak_bytes == peak
    assert "MLP product's or an RMSNorm's backward" in max(rank.phases, key=lambda p: p.bytes).note


@pytest.mark.slow  # four FSDP2 traces with compiled blocks in the fake process group, ~5 s each
@pytest.mark.parametrize("cfg,precision", [(LLAMA, "fp32"), (LLAMA, "fsdp-bf16"), (QWEN2, "fp32"),
                                           (QWEN2, "fsdp-bf16")])
def test_estimate_equals_the_fsdp2_compiled_op_trace(cfg, precision):
    # measured: 2,325,960 / 1,846,472 / 2,276,808 / 1,780,936 B, estimate == trace; the saved set too, less the
    # CPU generator state each checkpointed block's recomputed SDPA replays (5056 B of host memory, docs/compile.md)
    from trainmem.specs import ParallelSpec
    from trainmem.trace import trace_step

    step = StepSpec(batch=2, seq=64, precision=precision, optimizer="adamw")
    traced = trace_step(cfg, step, _impl(), parallel=ParallelSpec(**FSDP2))
    rank = _rank(cfg, precision)
    assert traced.meta["compile"]["saved_compiled_bytes"] + 4 == rank.totals_bytes["activation"] + 2 * 5056
    assert rank.peak_bytes == traced.peak_logical_bytes


@pytest.mark.slow  # two 2-D traces (HSDP, dp 4 in groups of 2) with compiled blocks, ~5 s each
@pytest.mark.parametrize("precision", ["fp32", "fsdp-bf16"])
def test_hsdp_equals_its_trace_and_fsdp2_over_its_shard_group(precision):
    # measured: 2,325,960 / 1,846,472 B, the 2-D trace's peak and FSDP2's over dp 2
    # (tests/estimate/test_compiled_hsdp.py)
    from trainmem.specs import ParallelSpec
    from trainmem.trace import trace_step

    step = StepSpec(batch=2, seq=64, precision=precision, optimizer="adamw")
    hsdp = ParallelSpec(dp=4, fsdp="hybrid", fsdp_group=2)
    (rank,) = estimate(spec_from_hf_config(LLAMA), step, _impl(), parallel=hsdp).ranks
    assert rank.peak_bytes == _rank(LLAMA, precision).peak_bytes
    assert rank.peak_bytes == trace_step(LLAMA, step, _impl(), parallel=hsdp).peak_logical_bytes
