"""FSDP2 under pipeline parallelism (issue 13, mechanism 5): torch.distributed.pipelining turns
off FSDP2's gradient sync and post-backward reshard for every micro-batch and reduce-scatters
once after the last (estimate/fsdp.py cites the functions), so a stage keeps its whole unsharded
gradient, and with ``reshard_after_forward`` every re-gathered block, until the end of backward.

The real run: 4 gloo ranks as a (pp=2, dp=2) mesh, each stage ``fully_shard``-ed per block and
at its root over its dp pair (torchtitan's PP + FSDP), GPipe and 1F1B with 4 micro-batches.
"""

from __future__ import annotations

import functools

import pytest

torch = pytest.importorskip("torch")
if not torch.distributed.is_available() or not torch.distributed.is_gloo_available():
    pytest.skip("torch.distributed with gloo is not available", allow_module_level=True)

from parallel_runs import CONFIG  # noqa: E402
from test_vs_estimate import IMPL, LEDGERS, STEP, TOL, _explain  # noqa: E402
from trainmem.estimate import estimate  # noqa: E402
from trainmem.measure_dist.launch import run_torchrun_many  # noqa: E402
from trainmem.specs import ParallelSpec  # noqa: E402
from trainmem.specs.loaders import spec_from_hf_config  # noqa: E402

MB = 4
CASES = [("gpipe", True), ("gpipe", False), ("1f1b", False)]  # (schedule, reshard_after_forward)


def _parallel(schedule: str, reshard: bool) -> ParallelSpec:
    return ParallelSpec(pp=2, dp=2, fsdp="full", schedule=schedule, microbatches=MB, reshard_after_forward=reshard)


@functools.lru_cache(maxsize=None)
def _launch() -> dict[tuple[str, bool], list[dict]]:
    scenarios = [dict(strategy="pp", pp_dp=2, schedule=s, reshard_after_forward=r, microbatches=MB) for s, r in CASES]
    return dict(zip(CASES, run_torchrun_many(4, scenarios, timeout=400)))


def _stage(est, r):
    return {c.name: c for c in est.ranks}[f"pp_stage_{r['pp_stage']}"]


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("schedule,reshard", CASES, ids=[f"{s}-{'reshard' if r else 'keep'}" for s, r in CASES])
def test_each_rank(schedule, reshard):
    """Model states byte-exact on every rank; in-flight activations and the step peak within TOL."""
    est = estimate(spec_from_hf_config(CONFIG), STEP, IMPL, parallel=_parallel(schedule, reshard))
    bad = []
    for r in _launch()[(schedule, reshard)]:
        cls = _stage(est, r)
        for ledger in LEDGERS:
            if cls.totals_bytes.get(ledger, 0) != r["states_bytes"][ledger]:
                bad.append(f"rank {r['rank']} {ledger}: {cls.totals_bytes.get(ledger, 0)} != {r['states_bytes'][ledger]}")
        for what, got, meas in (("activation", cls.totals_bytes["activation"], r["inflight_activation_bytes"]),
                                ("peak", cls.peak_bytes, r["peak_bytes"])):
            if abs(got - meas) > TOL * meas:
                bad.append(f"rank {r['rank']} {what}: estimate {got} vs measured {meas} ({got / meas:.4f})"
                           + _explain(r, cls))
    assert not bad, "\n".join(bad)


@pytest.mark.slow
@pytest.mark.distributed
def test_unsharded_gradient_is_the_stage_gradient_times_dp():
    """What the estimate keeps across micro-batches is the measured sharded gradient × dp (the
    tiny Llama's dimensions divide by 2: no padding), from the first backward on under 1F1B."""
    est = estimate(spec_from_hf_config(CONFIG), STEP, IMPL, parallel=_parallel("1f1b", False))
    for r in _launch()[("1f1b", False)]:
        parts = {p.name: p.parts for p in _stage(est, r).phases}
        for ph in ("forward", "backward", "backward_end"):
            assert parts[ph]["fsdp_pp_unsharded_grads"] == 2 * r["states_bytes"]["gradient"], (r["rank"], ph)


def test_phases_follow_the_schedule():
    """GPipe's first backward holds the head's and the last block's unsharded gradients; 1F1B
    every one from its first backward; the sharded gradients exist only at the end of backward."""
    model = spec_from_hf_config(CONFIG)
    full = estimate(model, STEP, IMPL)
    grad = full.totals_bytes["gradient"]
    for schedule in ("gpipe", "1f1b"):
        est = estimate(model, STEP, IMPL, parallel=_parallel(schedule, True))
        total_unsharded = 0
        for cls in est.ranks:
            parts = {p.name: p.parts for p in cls.phases}
            u = parts["backward_end"]["fsdp_pp_unsharded_grads"]
            assert u == 2 * cls.totals_bytes["gradient"]  # no padding at dp=2
            total_unsharded += u
            assert "gradients" not in parts["forward"] and "fsdp_reduce_scatter" not in parts["backward"]
            assert parts["backward_end"]["gradients"] == cls.totals_bytes["gradient"]
            first_backward = parts["backward"]["fsdp_pp_unsharded_grads"]
            assert (first_backward < u) if schedule == "gpipe" else (first_backward == u)
            # set_reshard_after_backward(False): every block is gathered by the first block's backward
            assert parts["backward_first_block"]["fsdp_pp_unsharded_params"] == parts["backward_end"][
                "fsdp_pp_unsharded_params"] > 0
        assert total_unsharded == grad  # the stages' unsharded gradients are the model's
