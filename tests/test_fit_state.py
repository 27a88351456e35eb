"""The three-state fit verdict (trainmem.fits.FIT_STATES): fits / fits only by flushing the
allocator cache / does not fit, one pure function and one field in every command that decides fit.

Mistral-7B (bf16 AdamW foreach, B=1, its default sdpa kernel) on H100-80GB, usable 78.65 GiB of
reserved memory (79.65 − 1 GiB context). The allocator model's unlimited-device reserved peak
(docs/plan.md, not monotone in S): S=2560 78.50 GiB fits; S=3584 84.95 GiB is over, but replayed
at 78.65 GiB with c10/cuda/CUDACachingAllocator.cpp's release-and-retry
(``DeviceCachingAllocator::malloc`` → ``release_cached_blocks`` → ``alloc_block`` again) the step
runs: one failed cudaMalloc per step frees the wholly free cached segments; S=6144 needs 84.13 GiB
allocated, which no flush helps.
"""

from __future__ import annotations

import json

import pytest

from trainmem.cli import main
from trainmem.estimate import estimate
from trainmem.estimate.allocation_order import estimate_fit_state, estimate_reserved, replay_with_flush
from trainmem.fits import FIT_STATES, fit_state
from trainmem.plan.hardware import load_gpu
from trainmem.specs import ImplSpec, StepSpec
from trainmem.specs.loaders import load_model

H100 = load_gpu("H100-80GB")
USABLE = H100.memory_bytes - H100.context_bytes  # the reserved figure's usable memory, one rank
WANT = {2560: "fits", 3584: "fits_with_cache_flush", 6144: "does_not_fit"}


@pytest.fixture(scope="module")
def mistral():
    return load_model("mistral-7b")


@pytest.fixture(scope="module")
def estimates(mistral):
    return {s: estimate(mistral, StepSpec(batch=1, seq=s, precision="bf16"), ImplSpec()) for s in WANT}


def test_fit_state_is_a_pure_function_of_the_figures():
    assert FIT_STATES == ("fits", "fits_with_cache_flush", "does_not_fit")
    assert fit_state(reserved_bytes=10, usable_bytes=10) == "fits"
    assert fit_state(reserved_bytes=10, usable_bytes=10, fits_after_flush=False) == "fits"
    assert fit_state(reserved_bytes=11, usable_bytes=10, fits_after_flush=True) == "fits_with_cache_flush"
    assert fit_state(reserved_bytes=11, usable_bytes=10, fits_after_flush=False) == "does_not_fit"
    assert fit_state(reserved_bytes=11, usable_bytes=10) == "does_not_fit"  # nothing replayed: two states


def test_mistral_on_h100_flips_through_the_three_states(estimates):
    for seq, want in WANT.items():
        e = estimates[seq]
        state, flush = estimate_fit_state(e, USABLE)
        assert state == want, seq
        reserved = estimate_reserved(e).reserved_bytes
        if want == "fits":
            assert reserved <= USABLE and flush is None
        elif want == "does_not_fit":
            assert e.peak_bytes > USABLE and flush is None  # the allocated peak alone is over
        else:
            assert e.peak_bytes <= USABLE < reserved
            assert flush.fits and flush.flushes == 1 and flush.flushed_bytes > reserved - USABLE
            assert e.peak_bytes <= flush.reserved_bytes <= USABLE  # max_memory_reserved on that device


def test_the_flush_replay_is_on_the_reserved_figures_footing(estimates):
    """A step that fits never releases, and its capped replay's reserved peak is the unlimited one, exactly."""
    e = estimates[2560]
    r = replay_with_flush(e, USABLE)
    assert r.fits and r.flushes == 0 and r.flushed_bytes == 0
    assert r.reserved_bytes == estimate_reserved(e).reserved_bytes


def test_estimate_gpu_json_and_text_state_it(capsys):
    from trainmem.schemas import schema_path
    jsonschema = pytest.importorskip("jsonschema")
    argv = ["estimate", "--model", "mistral-7b", "--seq", "3584", "--gpu", "H100-80GB"]
    assert main([*argv, "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert not list(jsonschema.Draft202012Validator(json.loads(schema_path("estimate").read_text())).iter_errors(d))
    v = d["fits"]
    assert v["fit_state"] == "fits_with_cache_flush" and v["fits"] is False and v["flushes"] == 1
    assert v["flush_reserved_bytes"] <= v["capacity_bytes"] - v["context_bytes"] < v["reserved_bytes"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "FITS ONLY BY FLUSHING THE ALLOCATOR CACHE on 1× H100-80GB" in out
    assert "short by 6.36 GiB against the reserved peak" in out and "release_cached_blocks" in out


def test_plan_advise_explain_serve_sweep_say_the_same(mistral, estimates):
    from trainmem.measure.sweeps import sweep
    from trainmem.plan.advise import advise
    from trainmem.plan.explain import weights_fit
    from trainmem.plan.search import SearchSpace, plan
    from trainmem.serve.api import _fit_state

    step = StepSpec(batch=1, seq=3584, precision="bf16")
    one = SearchSpace(attention=("sdpa",), recompute=("none",), tp=(1,), cp=(1,), pp=(1,), zero=(0,),
                      offload=((),), sp=(False,), max_micro_batch=1)
    p = plan(mistral, seq=3584, global_batch=1, gpu=H100, gpus=1, space=one, front=False)
    (c,) = p.candidates
    assert c.fit_state == "fits_with_cache_flush" and not c.fits and c.to_dict()["fit_state"] == c.fit_state
    a = advise(mistral, step, ImplSpec(), H100, budget=2, max_changes=1)
    assert a.fit_state == "fits_with_cache_flush" and a.to_dict()["fit_state"] == a.fit_state
    assert a.flush.fits and a.flush.flushes == 1
    ans = weights_fit(mistral, step, ImplSpec(), estimates[3584], H100)
    assert ans.numbers["fit_state"] == "fits_with_cache_flush" and ans.numbers["training_fits"] is False
    assert [_fit_state(estimates[s], USABLE) for s in WANT] == list(WANT.values())
    # sweep: the table's points carry the state; bisection still counts only "fits"
    r = sweep(mistral, step, ImplSpec(), over="seq", budget_bytes=USABLE, start=3584, stop=3584, multiple=64,
              fit_reserved=True)
    pt = next(p for p in r.points if p.value == 3584)
    assert pt.fit_state == "fits_with_cache_flush" and not pt.fits and pt.to_dict()["fit_state"] == pt.fit_state


def test_a_measured_step_says_which_state_it_ran_in():
    """profile on CUDA: the measured reserved peak already holds the real allocator's flushes, counted in
    memory_stats()["num_alloc_retries"]; over usable, a measured stream is not replayed (two answers)."""
    from trainmem.fits import measured_fit_state
    assert measured_fit_state(reserved_bytes=10, usable_bytes=10, alloc_retries=0) == "fits"
    assert measured_fit_state(reserved_bytes=10, usable_bytes=10, alloc_retries=2) == "fits_with_cache_flush"
    assert measured_fit_state(reserved_bytes=10, usable_bytes=10, alloc_retries=2, ooms=1) == "does_not_fit"
    assert measured_fit_state(reserved_bytes=11, usable_bytes=10, alloc_retries=0) == "does_not_fit"


def test_profile_verdict_from_measured_retries():
    import argparse

    from trainmem.fitargs import profile_fit
    from trainmem.measure.profile_result import ProfileResult, RankProfile
    gib = 1 << 30

    def result(retries):
        rank = RankProfile(rank=0, device="cuda:0 (NVIDIA H100 80GB HBM3)", peak_bytes=70 * gib,
                           peak_reserved_bytes=76 * gib, peak_active_bytes=70 * gib, num_alloc_retries=retries,
                           num_ooms=0, baseline_bytes=0, context_bytes=None, tokens_per_s=None, step_time_s=1.0,
                           totals_bytes={})
        return ProfileResult((rank,))

    args = argparse.Namespace(gpu="H100-80GB", gpu_memory=None, memory_figure="reserved")
    fit, text = profile_fit(args, result(0))
    assert (fit["fits"]["fit_state"], fit["fits"]["fits"]) == ("fits", True)
    fit, text = profile_fit(args, result(3))
    assert (fit["fits"]["fit_state"], fit["fits"]["fits"]) == ("fits_with_cache_flush", False)
    assert fit["fits"]["headroom_bytes"] == USABLE - 76 * gib  # the measured peak is the one with the flushes
    assert "FITS ONLY BY FLUSHING THE ALLOCATOR CACHE on 1× H100-80GB: needs 76.00 GiB reserved" in text
    assert "retried 3× during the timed steps" in text
    fit, text = profile_fit(argparse.Namespace(gpu="custom", gpu_memory="76GiB", memory_figure="reserved"), result(0))
    assert fit["fits"]["fit_state"] == "does_not_fit" and "is not replayed at another capacity" in text
