"""``trace --pp 2`` against a real 2-rank gloo pipelining step (torchrun; ``measure_dist/worker.py``,
strategy ``pp``: the tiny Llama, 4 layers, B 2 per micro-batch, S 64, fp32, AdamW foreach,
4 micro-batches, GPipe and 1F1B, one stage per rank, its PipelineStage inferring shapes at run time).

Measured (one launch, ~55 s of torchrun on 2 shared cores), every rank of both schedules:
  - parameters, gradients, AdamW states, module buffers and PipelineStage's receive buffers
    (4 x B·S·H·4 per rank): trace == real to the byte (the real run's AdamW CPU step counters,
    76 B on rank 0 and 80 B on rank 1, are its ``optimizer_step`` ledger, not traced);
  - step peak: trace + the step counters == the real step's op-boundary peak (``LiveTracker``, a
    dispatch mode, as the tracer) to the byte (GPipe 7,097,484 / 8,319,920 B, 1F1B 4,804,748 /
    4,218,532 B). Under 1F1B rank 0 matches because the trace holds each send's tensor as long as
    the schedule holds its Work (gloo's send Work references its tensor; Schedule1F1B keeps the
    first warm-up send's Work until the steady phase ends): without it the trace was one stage
    output (32,768 B) under;
  - saved activations held at once: trace == real less the ids the first stage's embedding saves
    (the whole batch's, B·M·S·8: the micro-batches are views of it; the trace counts them as its
    input) and less the receive buffers the last stage's first block saves, one per micro-batch in
    flight (GPipe 4, 1F1B 1; the trace counts them as buffers).
FSDP2 under PP (4 ranks as a (pp 2, dp 2) mesh, 1F1B): the same, to the byte, for data-parallel rank 0
of each stage.
"""

from __future__ import annotations

import collections

import pytest

torch = pytest.importorskip("torch")
if not torch.distributed.is_available() or not torch.distributed.is_gloo_available():
    pytest.skip("torch.distributed with gloo is not available", allow_module_level=True)

from trainmem.measure_dist.launch import run_torchrun_many  # noqa: E402
from trainmem.measure_dist.worker import DEFAULT_CONFIG, DEFAULTS  # noqa: E402
from trainmem.specs import ImplSpec, ParallelSpec, StepSpec  # noqa: E402
from test_trace_pp import held_activations  # noqa: E402

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

SCHEDULES = ("gpipe", "1f1b")
M = 4


def test_trace_pp2_equals_a_real_gloo_pipeline_step():
    from trainmem.trace import trace_step

    runs = run_torchrun_many(2, [dict(strategy="pp", schedule=s, microbatches=M, tracked_repeats=3) for s in SCHEDULES],
                             timeout=900)
    B, S, H = DEFAULTS["batch"], DEFAULTS["seq"], DEFAULT_CONFIG["hidden_size"]
    one, ids = B * S * H * 4, B * S * 8
    step = StepSpec(batch=B, seq=S, precision="fp32", optimizer="adamw")
    impl = ImplSpec(device="cpu", attention="sdpa", optimizer_impl="foreach")
    bad = []
    for schedule, ranks in zip(SCHEDULES, runs):
        for real in ranks:
            r = real["rank"]
            traced = trace_step(DEFAULT_CONFIG, step, impl, parallel=ParallelSpec(pp=2, schedule=schedule,
                                                                                  microbatches=M), pp_rank=r)
            led: dict[str, int] = collections.defaultdict(int)
            for it in traced.items:
                led[it.category.value] += it.bytes
            recv = sum(i.bytes for i in traced.items if i.name.startswith("pipeline.stage"))
            got = {"parameter": led["parameter"], "gradient": led["gradient"],
                   "optimizer_state": led["optimizer_state"], "buffer": led["buffer"] - recv, "recv": recv,
                   "peak": traced.peak_logical_bytes + real["states_bytes"]["optimizer_step"],
                   "saved": held_activations(traced, saved_only=True)
                   + (M * ids if r == 0 else (M if schedule == "gpipe" else 1) * one)}
            want = {**{k: real["states_bytes"][k] for k in ("parameter", "gradient", "optimizer_state", "buffer")},
                    "recv": real["pp_recv_buffers_bytes"],
                    "peak": min(real["peak_bytes"], *real["op_boundary_peaks_bytes"]),  # gloo's late release: below
                    "saved": real["inflight_activation_bytes"]}
            bad += [f"{schedule} rank {r} {k}: trace {got[k]} != real {want[k]}" for k in want if got[k] != want[k]]
    assert not bad, "\n".join(bad)


def test_trace_fsdp2_under_pp_equals_a_real_gloo_step():
    """``--pp 2 --dp 2 --fsdp full`` (1F1B, 4 micro-batches) against 4 real gloo ranks as a (pp, dp) mesh,
    each stage ``fully_shard``-ed per block and as the stage root (the worker's ``pp_dp``; ~75 s of torchrun):
    for data-parallel rank 0 of each stage, sharded parameters, gradients, AdamW states, buffers and receive
    buffers == real to the byte, and the trace's peak + AdamW's step counters == the real op-boundary peak
    (4,587,148 B on pipeline rank 0, 3,721,764 B on rank 1), unsharded gradients kept across micro-batches.

    One allowance, for a race in the real run, not in the model: gloo runs every collective on a worker thread
    (``ProcessGroupGloo.cpp`` ``runLoop``: ``AsyncWork::execute`` marks the work complete, and only then does the
    thread retake its lock and reset ``workInProgress_``), so a finished all-gather's or reduce-scatter's buffers
    can outlive FSDP2's last reference to them until that thread is scheduled again. The CI run at 4e1e908
    (2 loaded cores) read pipeline rank 0's peak 65,536 B over the trace, one of rank 0's stage-root buffers
    (the embedding, 256 x 64 x 4); 10 local runs, 5 of them under extra load, read the trace's figure. So the
    real peak may exceed the trace by exactly one of the stage's FSDP2 collective buffers, and only when a
    storage of that size is live and unattributed at the real peak (``peak_other_sizes``).
    The CI run at a1d9a01 read +20,480 B, a peak at another op with other buffers held. The race only adds
    bytes, so the worker now tracks four steps (``tracked_repeats``) and the real peak is the least of them."""
    from trainmem.trace import trace_step

    (ranks,) = run_torchrun_many(4, [dict(strategy="pp", pp_dp=2, schedule="1f1b", microbatches=M,
                                                    tracked_repeats=3)], timeout=900)
    step = StepSpec(batch=DEFAULTS["batch"], seq=DEFAULTS["seq"], precision="fp32", optimizer="adamw")
    impl = ImplSpec(device="cpu", attention="sdpa", optimizer_impl="foreach")
    par = ParallelSpec(pp=2, dp=2, fsdp="full", schedule="1f1b", microbatches=M)
    bad = []
    for real in ranks[::2]:  # data-parallel rank 0 of pipeline ranks 0 and 1 (global ranks 0 and 2)
        r = real["pp_stage"]
        traced = trace_step(DEFAULT_CONFIG, step, impl, parallel=par, pp_rank=r)
        led: dict[str, int] = collections.defaultdict(int)
        for it in traced.items:
            led[it.category.value] += it.bytes
        recv = sum(i.bytes for i in traced.items if i.name.startswith("pipeline.stage"))
        got = {**{k: led[k] for k in ("parameter", "gradient", "optimizer_state")}, "buffer": led["buffer"] - recv,
               "recv": recv, "peak": traced.peak_logical_bytes + real["states_bytes"]["optimizer_step"]}
        want = {**{k: real["states_bytes"][k] for k in ("parameter", "gradient", "optimizer_state", "buffer")},
                "recv": real["pp_recv_buffers_bytes"],
                "peak": min(real["peak_bytes"], *real["op_boundary_peaks_bytes"])}
        late = want["peak"] - got["peak"]
        if late in _gloo_held_buffers(r) and late in real["peak_other_sizes"]:  # see the docstring
            want["peak"] = got["peak"]
        bad += [f"pipeline rank {r} {k}: trace {got[k]} != real {want[k]} (real peak after {real['peak_op']}, "
                f"{real['peak_parts']}, unattributed {real['peak_other_sizes']}, "
                f"more steps {real['op_boundary_peaks_bytes']})" for k in want if got[k] != want[k]]
    assert not bad, "\n".join(bad)


def _gloo_held_buffers(stage: int, dp: int = 2) -> set[int]:
    """The byte sizes of stage ``stage``'s FSDP2 collective buffers (fp32, 2 stages of the tiny Llama):
    all-gather output = reduce-scatter input = the group's unsharded bytes, and its 1/dp shard."""
    H, I, V, q, kv = 64, 176, 256, 64, 32  # DEFAULT_CONFIG: hidden, intermediate, vocab, q and k/v widths
    block = (H * q + 2 * H * kv + q * H + 3 * H * I + 2 * H) * 4  # 46,208 parameters = 184,832 B
    root = (V * H if stage == 0 else H + V * H) * 4  # embedding, or final norm + lm_head: 65,536 / 65,792 B
    return {n // k for n in (block, root) for k in (1, dp)}
