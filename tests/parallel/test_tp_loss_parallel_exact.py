"""``--tp 2 [--sp] [--no-loss-parallel]``, ``--recompute none``: estimate == trace == a real gloo step, to the byte.

The step's top is the vocab-parallel loss's fused backward (torch/distributed/tensor/parallel/loss.py
``_nll_loss_and_log_softmax_backward``, inside ``NllLossBackward0``): the saved log-softmax, ``zeros_like``,
``exp`` and their sum (B·S·V/tp each, fp32), the handler's per-row index tensors and nll's saved target
(estimate/loss_parallel.py ``fused_backward_rows``). The trace saw none of the handler's local tensors (its
dispatch mode runs the DTensor op with itself popped, so DTensor's handler computes below it) and read
84 KB (fp32 sp) under the real step, estimate/trace 1.04-1.05; trace/dtensor_handlers.py ``loss_handlers_seen``
runs the handlers with the recorder pushed back. The estimate was 5,252 B under (the row tensors).

With the logits all-gathered (``--no-loss-parallel``) the top is the log-softmax's backward, and the trace read
65,528 B (fp32) and 81,912 B (fp32 --sp) over the real step: funcol's ``wait_tensor`` returns its input on a real
group, but its Meta kernel makes a new tensor, so the fake trace held the all-gather's output twice
(trace/dtensor_handlers.py ``waits_return_their_input``).

Tiny Llama (H64 F176 L4 A4 KV2 V256), B2 S64. The real step: torchrun, 2 ranks, gloo (measure_dist/worker.py,
the same torchtitan layout), its CPU allocator's peak read by torch.profiler (``profile_memory``), the least of
three steps on each rank (a collective's buffer freed on gloo's thread is never recorded, so a reading is an
upper bound: measure_dist/worker.py ``_profiled_peak``; the least equalled the estimate in all eight cases
on idle cores, one missed buffer over on loaded ones). It leaves out the input ids, made before the step
(B·S·8 = 1,024 B, which the trace and the estimate count) and counts AdamW's host step counters (39 × 4 B).
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
if not torch.distributed.is_available():  # pragma: no cover
    pytest.skip("torch.distributed is not available", allow_module_level=True)

from trainmem.estimate import estimate  # noqa: E402
from trainmem.specs import ImplSpec, ParallelSpec, StepSpec  # noqa: E402
from trainmem.specs.loaders import spec_from_hf_config  # noqa: E402

pytestmark = pytest.mark.slow

CONFIG = dict(model_type="llama", hidden_size=64, intermediate_size=176, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, vocab_size=256, max_position_embeddings=256, tie_word_embeddings=False)
B, S = 2, 64
IDS = B * S * 8  # the input ids (int64), made before the real step's profiled window
STEP_COUNTERS = 39 * 4  # the real AdamW's host step tensors, one per parameter (fp32)
MISSED = 2 * B * S * CONFIG["vocab_size"] * 4 // 2  # the most unrecorded frees seen in one reading (CI: 131,072 B)
PEAKS = {  # (precision, sp, loss_parallel): the step peak, bytes
    ("fp32", True, True): 3_099_852,
    ("fp32", False, True): 3_397_068,
    ("bf16", True, True): 1_761_100,
    ("bf16", False, True): 1_984_588,
    ("fp32", True, False): 3_225_672,
    ("fp32", False, False): 3_522_888,
    ("bf16", True, False): 1_886_920,
    ("bf16", False, False): 2_110_408,
}


def _step(precision: str) -> StepSpec:
    return StepSpec(batch=B, seq=S, precision=precision, optimizer="adamw")


@pytest.mark.parametrize("precision,sp,loss_parallel", sorted(PEAKS))
def test_estimate_equals_trace(precision, sp, loss_parallel):
    from trainmem.trace import trace_step

    impl = ImplSpec(device="cpu", attention="sdpa")
    par = ParallelSpec(tp=2, sp=sp, loss_parallel=loss_parallel)
    (rank,) = estimate(spec_from_hf_config(CONFIG), _step(precision), impl, par).ranks
    traced = trace_step(CONFIG, _step(precision), impl, parallel=par)
    assert traced.peak_logical_bytes == PEAKS[precision, sp, loss_parallel]
    assert (rank.peak.name, rank.peak_bytes) == ("backward_start", PEAKS[precision, sp, loss_parallel])
    if not loss_parallel:
        return
    # the fused backward's local tensors, recorded: the log-softmax's gradient made by the handler's add
    assert traced.peak_op == "add", traced.peak_op
    # 3·B·S·V/tp + the rows' 5,252 B (128 rows, fp32: fused_backward_rows)
    u = B * S * CONFIG["vocab_size"] // 2 * 4
    assert rank.peak.parts["logits_grad"] == 3 * u and rank.peak.parts["loss_parallel_rows"] == 5_252


@pytest.mark.distributed
def test_real_gloo_step_equals_estimate():
    """One torchrun launch (8 scenarios, ~2 min on 2 shared cores): the least allocator reading over both
    ranks and three steps each, with the ids and step counters accounted, equals the estimate (== the trace)
    or exceeds it by whole collective buffers that gloo's worker thread freed unrecorded."""
    if not torch.distributed.is_gloo_available():
        pytest.skip("gloo is not available")
    from trainmem.measure_dist.launch import run_torchrun_many

    cases = sorted(PEAKS)
    runs = run_torchrun_many(2, [dict(strategy="tp", precision=p, sp=sp, loss_parallel=lp, profile_step=True)
                                 for p, sp, lp in cases], timeout=1200)
    impl = ImplSpec(device="cpu", attention="sdpa", optimizer_impl="foreach")  # the worker steps foreach AdamW
    for case, ranks in zip(cases, runs):
        precision, sp, lp = case
        real = min(p for r in ranks for p in r["profiled_peaks_bytes"]) - STEP_COUNTERS + IDS
        (rank,) = estimate(spec_from_hf_config(CONFIG), _step(precision), impl,
                           ParallelSpec(tp=2, sp=sp, loss_parallel=lp)).ranks
        assert rank.peak_bytes == PEAKS[case]
        # an upper bound by the collective buffers gloo's worker thread freed unrecorded: equal in all eight cases
        # of two launches; on loaded cores all six readings of a case can miss such a free (measured once each:
        # bf16 sp loss_parallel +16,384 B, a B·S·H bf16 buffer; fp32 sp loss_parallel +512 B, the loss's (B·S, 1)
        # fp32 all-reduce; CI once +131,072 B, test_trace_tp_real.py)
        over = real - PEAKS[case]
        assert 0 <= over <= MISSED and over % 512 == 0, (case, [r["profiled_peaks_bytes"] for r in ranks])
