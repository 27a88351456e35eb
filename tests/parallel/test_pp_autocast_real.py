"""``--precision amp-bf16`` under ``--pp``: the trace's per-rank step against a real 2-rank gloo pipelining step whose
schedule runs under one ``torch.autocast`` (tests/parallel/pp_autocast_worker.py), the case estimate/autocast_cache.py
models: one cached bf16 copy of each stage weight for the whole step, a later micro-batch's bf16 weight gradients
deferred to the end of its backward.

Tiny Llama (the worker's config), B 2 per micro-batch, S 64, fp32 weights under bf16 autocast, AdamW foreach,
1F1B with 4 micro-batches, sdpa. Per rank: parameters, gradients, AdamW states, buffers and receive buffers == the
trace to the byte; the real step's op-boundary peak == the trace's + AdamW's CPU step counters (as
tests/parallel/test_pp_every_k_real.py reads them); and estimate() == the trace (tests/estimate/test_pp_autocast.py).
"""

from __future__ import annotations

import collections

import pytest

torch = pytest.importorskip("torch")
if not torch.distributed.is_available() or not torch.distributed.is_gloo_available():
    pytest.skip("torch.distributed with gloo is not available", allow_module_level=True)

from torchrun_scripts import launch  # noqa: E402

pytestmark = [pytest.mark.distributed, pytest.mark.slow]  # one torchrun launch, ~60-120 s on 2 shared cores

M = 4
LEDGERS = ("parameter", "gradient", "optimizer_state", "buffer")


def test_trace_under_autocast_per_rank_equals_a_real_gloo_pipeline_step():
    from trainmem.estimate import estimate
    from trainmem.measure_dist.worker import DEFAULT_CONFIG, DEFAULTS
    from trainmem.specs import ImplSpec, ParallelSpec, StepSpec
    from trainmem.specs.loaders import spec_from_hf_config
    from trainmem.trace import trace_step

    runs = launch("pp_autocast_worker.py", {"1f1b": dict(strategy="pp", schedule="1f1b", microbatches=M,
                                                         autocast="bf16", tracked_repeats=3)}, timeout=900)
    step = StepSpec(batch=DEFAULTS["batch"], seq=DEFAULTS["seq"], precision="amp-bf16", optimizer="adamw")
    impl = ImplSpec(device="cpu", attention="sdpa", optimizer_impl="foreach")
    par = ParallelSpec(pp=2, schedule="1f1b", microbatches=M)
    ranks = estimate(spec_from_hf_config(DEFAULT_CONFIG), step, impl, par).ranks
    bad = []
    for real in runs["1f1b"]:
        r = real["pp_stage"]
        traced = trace_step(DEFAULT_CONFIG, step, impl, parallel=par, pp_rank=r)
        sums: dict[str, int] = collections.Counter()
        for it in traced.items:
            sums["recv" if it.name.startswith("pipeline.stage") else it.category.value] += it.bytes
        got = {**{k: sums[k] for k in (*LEDGERS, "recv")},
               "peak": traced.peak_logical_bytes + real["states_bytes"]["optimizer_step"]}
        want = {**{k: real["states_bytes"][k] for k in LEDGERS}, "recv": real["pp_recv_buffers_bytes"],
                "peak": min(real["peak_bytes"], *real["op_boundary_peaks_bytes"])}
        bad += [f"rank {r} {k}: trace {got[k]} != real {want[k]}" for k in want if got[k] != want[k]]
        bad += [f"rank {r}: estimate {ranks[r].peak_bytes} != trace {traced.peak_logical_bytes}"] * (
            ranks[r].peak_bytes != traced.peak_logical_bytes)
    assert not bad, "\n".join(bad)
