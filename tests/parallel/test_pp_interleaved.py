"""Interleaved 1F1B against 1F1B (issue 13): what each pipeline rank really holds.

torch.distributed.pipelining runs interleaved 1F1B as a list of actions per rank
(estimate/pp_schedule.py reproduces it; checked here action for action against torch's own
``ScheduleInterleaved1F1B._calculate_single_rank_operations`` and ``_add_reduce_grad``), and
reduces each virtual stage's gradients right after that stage's last backward. Under FSDP2 a
virtual stage's unsharded gradients therefore live only from its first backward to its own last
one: the later virtual stage's backwards run first, so at a rank's worst moment only part of its
gradients exist, where 1F1B holds all of them. That is why torchtitan's Llama-3.1-405B 3D rows
read ~10 GiB less under interleaved 1F1B (bench/published/cases.json).

The real run: 4 gloo ranks as a (pp=2, dp=2) mesh, each stage FSDP2-sharded per block and at its
root (torchtitan's PP + FSDP, ``reshard_after_forward=False`` as torchtitan sets it under PP),
1F1B and interleaved 1F1B with 2 stages per rank, 4 micro-batches.
"""

from __future__ import annotations

import functools

import pytest

torch = pytest.importorskip("torch")

from trainmem.estimate.pp_schedule import rank_actions, timeline, virtual_split  # noqa: E402


def _torch_order(pp: int, v: int, m: int, rank: int):
    """torch's own generator, on a bare instance: it reads only these four sizes."""
    from torch.distributed.pipelining.schedules import (
        ScheduleInterleaved1F1B, _add_reduce_grad, _ComputationType as C,
    )

    s = object.__new__(ScheduleInterleaved1F1B)
    s.pp_group_size, s.n_local_stages, s._n_microbatches = pp, v, m
    s.number_of_rounds = max(1, m // pp)
    s.microbatches_per_round = m // s.number_of_rounds
    ops = _add_reduce_grad(s._calculate_single_rank_operations(rank), m)
    kind = {C.FORWARD: "F", C.FULL_BACKWARD: "B", C.REDUCE_GRAD: "R"}
    return [(kind[a.computation_type], (a.stage_index - rank) // pp,
             -1 if a.microbatch_index is None else a.microbatch_index) for a in ops if a is not None]


@pytest.mark.slow  # importing torch.distributed.pipelining alone takes seconds
def test_interleaved_order_is_torchs():
    for pp, v, m in [(2, 2, 2), (2, 2, 4), (4, 2, 4), (4, 3, 8), (8, 2, 8), (8, 2, 16), (3, 2, 6), (4, 2, 6)]:
        for rank in range(pp):
            assert rank_actions("interleaved", pp=pp, v=v, m=m, rank=rank) == _torch_order(pp, v, m, rank), (pp, v, m)


def test_timeline_of_the_405b_first_rank():
    """pp=8, v=2, m=8, rank 0: all 16 forwards first (warm-up (2-1)·8 + 2·7 = 22, capped at 16),
    then stage 8's 8 backwards and its reduction, then stage 0's. Virtual stages of 7 and 8
    layers (torchtitan's 7, 8 x 14, 7): the worst backward is stage 8's first, with every chunk
    held and only stage 8's gradients."""
    acts = rank_actions("interleaved", pp=8, v=2, m=8, rank=0)
    assert [a[0] for a in acts[:16]] == ["F"] * 16 and acts[16] == ("B", 1, 0) and acts[24] == ("R", 1, -1)
    assert virtual_split(15, 2, 0, 8) == [7, 8] and virtual_split(15, 2, 7, 8) == [8, 7]
    assert virtual_split(16, 2, 3, 8) == [8, 8]
    tl = timeline(acts, held=[7.0, 8.0], grads=[700.0, 800.0])
    assert tl.max_held == 8 * 7 + 8 * 8 == tl.backward_held  # 120
    assert tl.backward_grads == 800 and tl.forward_grads == 0 and tl.end_grads == 700
    one = timeline(rank_actions("1f1b", pp=8, v=1, m=8, rank=0), held=[15.0], grads=[1500.0])
    assert one.max_held == one.backward_held == 8 * 15 and one.backward_grads == 1500


# --- the real run ------------------------------------------------------------------------------

MB = 4
CASES = ("1f1b", "interleaved")


@functools.lru_cache(maxsize=None)
def _launch() -> dict[str, list[dict]]:
    from trainmem.measure_dist.launch import run_torchrun_many

    scenarios = [dict(strategy="pp", pp_dp=2, schedule=s, virtual_stages=2 if s == "interleaved" else 1,
                      reshard_after_forward=False, microbatches=MB) for s in CASES]
    return dict(zip(CASES, run_torchrun_many(4, scenarios, timeout=400)))


def _estimate(schedule: str):
    from parallel_runs import CONFIG
    from test_vs_estimate import IMPL, STEP
    from trainmem.estimate import estimate
    from trainmem.specs import ParallelSpec
    from trainmem.specs.loaders import spec_from_hf_config

    par = ParallelSpec(pp=2, dp=2, fsdp="full", schedule=schedule, microbatches=MB, reshard_after_forward=False,
                       virtual_stages=2 if schedule == "interleaved" else 1)
    return {c.name: c for c in estimate(spec_from_hf_config(CONFIG), STEP, IMPL, parallel=par).ranks}


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("schedule", CASES)
def test_each_rank_against_torch(schedule):
    """States byte-exact; in-flight activations and the step peak within TOL on every rank."""
    if not torch.distributed.is_available() or not torch.distributed.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    from test_vs_estimate import LEDGERS, TOL

    est = _estimate(schedule)
    exact, near = {}, {}  # (rank, what): (estimate, measured)
    for r in _launch()[schedule]:
        cls = est[f"pp_stage_{r['pp_stage']}"]
        exact.update({(r["rank"], k): (cls.totals_bytes.get(k, 0), r["states_bytes"][k]) for k in LEDGERS})
        near[r["rank"], "activation"] = (cls.totals_bytes["activation"], r["inflight_activation_bytes"])
        near[r["rank"], "peak"] = (cls.peak_bytes, r["peak_bytes"])
    assert {k: e for k, (e, m) in exact.items() if e != m} == {}, exact
    assert {k: round(e / m, 4) for k, (e, m) in near.items() if abs(e - m) > TOL * m} == {}, near


@pytest.mark.slow
@pytest.mark.distributed
def test_interleaved_holds_less_than_1f1b_by_what_the_estimate_says():
    """The measured peak difference between the schedules, rank by rank, against the estimate's."""
    if not torch.distributed.is_available() or not torch.distributed.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    from test_vs_estimate import TOL

    runs = _launch()
    e1, ei = _estimate("1f1b"), _estimate("interleaved")
    for a, b in zip(runs["1f1b"], runs["interleaved"]):
        name = f"pp_stage_{a['pp_stage']}"
        measured = a["peak_bytes"] - b["peak_bytes"]
        estimated = e1[name].peak_bytes - ei[name].peak_bytes
        assert abs(estimated - measured) <= TOL * a["peak_bytes"], (a["rank"], estimated, measured)
