"""``--recompute every-k`` under ``--pp``: the trace's per-rank count against a real 2-rank gloo pipelining step
that checkpoints as torchtitan does (tests/parallel/pp_every_k_worker.py: the measure worker's ``pp`` strategy,
each stage's blocks wrapped by a per-process counter, ``checkpoint_wrapper`` on every k-th), and as transformers does
(``--recompute-from first``: ``activation_checkpointing_enable(every_n_layers=k)`` on the whole model, then the cut).

Tiny Llama with 6 layers (the worker's config otherwise), B 2 per micro-batch, S 64, fp32, AdamW foreach,
4 micro-batches, k=2: each rank wraps its 2nd block, blocks 1 and 4; transformers' count flags the model's 0, 2, 4.
Per rank and schedule: the wrapped blocks == ``place_every_k_trace``'s; parameters, gradients, AdamW states,
buffers and receive buffers == the trace to the byte; the real step's op-boundary peak == the trace's + AdamW's
CPU step counters (as tests/trace/test_trace_pp_real.py reads them; the least of four tracked steps, gloo's late
release only adding bytes).
"""

from __future__ import annotations

import collections

import pytest

torch = pytest.importorskip("torch")
if not torch.distributed.is_available() or not torch.distributed.is_gloo_available():
    pytest.skip("torch.distributed with gloo is not available", allow_module_level=True)

from torchrun_scripts import launch  # noqa: E402

pytestmark = [pytest.mark.distributed, pytest.mark.slow]  # one torchrun launch per test, ~60-120 s on 2 shared cores

SCHEDULES = ("gpipe", "1f1b")
M, K, LAYERS = 4, 2, 6
LEDGERS = ("parameter", "gradient", "optimizer_state", "buffer")


def _traced(traced, step_counters: int) -> dict[str, int]:
    """The trace's ledgers, its receive buffers apart from the other buffers, and its peak with AdamW's CPU step
    counters (the real run's ``optimizer_step`` ledger, which the trace does not hold)."""
    sums: dict[str, int] = collections.Counter()
    for it in traced.items:
        sums["recv" if it.name.startswith("pipeline.stage") else it.category.value] += it.bytes
    return {**{k: sums[k] for k in (*LEDGERS, "recv")}, "peak": traced.peak_logical_bytes + step_counters}


def _trace_equals_real(every_from: str, blocks) -> None:
    """Launch the worker under both schedules with ``every_from``'s count; per rank, the wrapped blocks ==
    ``place_every_k_trace``'s == ``blocks(a, b)`` (the rank's ``[a, b)``), and the trace == the real step."""
    from trainmem.measure_dist.worker import DEFAULT_CONFIG, DEFAULTS
    from trainmem.specs import ImplSpec, ParallelSpec, StepSpec
    from trainmem.trace import trace_step
    from trainmem.trace.recompute import place_every_k_trace

    cfg = dict(DEFAULT_CONFIG, num_hidden_layers=LAYERS)
    runs = launch("pp_every_k_worker.py", {s: dict(strategy="pp", config=cfg, schedule=s, microbatches=M, every=K,
                                                   every_from=every_from, tracked_repeats=3) for s in SCHEDULES},
                  timeout=900)
    step = StepSpec(batch=DEFAULTS["batch"], seq=DEFAULTS["seq"], precision="fp32", optimizer="adamw")
    impl = ImplSpec(device="cpu", attention="sdpa", optimizer_impl="foreach", recompute="every-k", recompute_every=K,
                    recompute_from=every_from)
    bad = []
    for schedule in SCHEDULES:
        par = ParallelSpec(pp=2, schedule=schedule, microbatches=M)
        placed = place_every_k_trace(impl, par, LAYERS)
        for real in runs[schedule]:
            r = real["pp_stage"]
            a, b = r * LAYERS // 2, (r + 1) * LAYERS // 2
            assert real["wrapped_blocks"] == [i for i in range(a, b) if placed.checkpointed(i)] == blocks(a, b)
            traced = trace_step(cfg, step, placed, parallel=par, pp_rank=r)
            got = _traced(traced, real["states_bytes"]["optimizer_step"])
            want = {**{k: real["states_bytes"][k] for k in LEDGERS}, "recv": real["pp_recv_buffers_bytes"],
                    "peak": min(real["peak_bytes"], *real["op_boundary_peaks_bytes"])}
            bad += [f"{schedule} rank {r} {k}: trace {got[k]} != real {want[k]}" for k in want if got[k] != want[k]]
    assert not bad, "\n".join(bad)


def test_trace_every_k_per_rank_equals_a_real_gloo_pipeline_step():
    _trace_equals_real("kth", lambda a, b: [a + 1])  # each rank's 2nd block


def test_trace_first_per_rank_equals_a_real_gloo_pipeline_step():
    """``--recompute-from first`` under PP: transformers' ``activation_checkpointing_enable(every_n_layers=2)`` on
    the whole model before the cut flags the model's blocks 0, 2, 4 (rank 0: 0 and 2, the stage's last; rank 1: 4);
    the trace (``place_every_k_trace``: the whole model's count) == the real step per rank, ledgers and peak."""
    _trace_equals_real("first", lambda a, b: [i for i in range(a, b) if i % K == 0])
