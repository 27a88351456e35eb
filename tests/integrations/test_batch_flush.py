"""The integrations in three states (trainmem.fits.FIT_STATES): check_run's verdict and
largest_micro_batch's two bounds, the largest micro-batch that fits and the largest that runs
only by flushing the allocator cache.

Mistral-7B, bf16 AdamW (foreach), S=1024, on H100-80GB (usable 84,447,068,160 B of reserved memory:
capacity − the preset's 1 GiB context). The estimate's allocation order replayed through the
caching-allocator model (estimate/allocation_order.py): B=4 fits (reserved 79,094,087,680 B);
B=5 is over usable (85,685,436,416 B) but replayed at usable with the allocator's release-and-retry
(c10/cuda/CUDACachingAllocator.cpp DeviceCachingAllocator::malloc → release_cached_blocks) it runs:
one flush per step frees 9,179,234,304 B, reserved peak 84,393,590,784 B with it; B=6 does not run.
"""

import logging

import pytest

import trainmem
from trainmem.integrations.check import RunSpec, check_run, resolve_budget
from trainmem.integrations.text import check_lines
from trainmem.specs import ImplSpec, StepSpec
from trainmem.specs.loaders import load_model

USABLE = 84_379_959_296  # 79.65 GiB less the context: 1 GiB and two 32 MiB cuBLAS workspaces (device_context.py)


@pytest.fixture(scope="module")
def mistral():
    return load_model("mistral-7b")


def _check(mistral, batch):
    run = RunSpec(model=mistral, step=StepSpec(batch=batch, seq=1024, precision="bf16"), impl=ImplSpec())
    return check_run(run, resolve_budget(gpu="H100-80GB"))


def test_check_run_states_the_three_answers(mistral):
    fits, flush = (_check(mistral, b) for b in (4, 5))
    assert fits.budget.usable_bytes == USABLE
    assert (fits.fit_state, fits.fits, fits.runs, fits.flush, fits.advice) == ("fits", True, True, None, None)
    assert (flush.fit_state, flush.fits, flush.runs) == ("fits_with_cache_flush", False, True)
    assert flush.predicted_reserved_bytes == 85_685_436_416 > USABLE
    f = flush.flush
    assert (f.fits, f.flushes, f.flushed_bytes, f.reserved_bytes) == (True, 1, 9_179_234_304, 84_276_150_272)
    assert flush.advice is not None  # advise's ladder: what makes it fit without flushing
    d = flush.to_dict()
    assert d["fits"] is False and d["fit_state"] == "fits_with_cache_flush" and d["flush"]["flushes"] == 1
    text = "\n".join(check_lines(flush))
    assert "fits ONLY BY FLUSHING THE ALLOCATOR CACHE (reserved peak over by 1.22 GiB)" in text
    assert "release_cached_blocks" in text and "applied in order to fit without flushing" in text


def test_largest_micro_batch_reports_both_bounds(mistral):
    fit = trainmem.largest_micro_batch(mistral, step=StepSpec(seq=1024, precision="bf16"), gpu="H100-80GB")
    assert (fit.batch, fit.batch_with_flush, fit.capped, fit.capped_with_flush) == (4, 5, False, False)
    assert fit.reserved_bytes == 79_094_087_680 <= USABLE < fit.next_reserved_bytes == 85_685_436_416
    assert fit.fit_state == "fits_with_cache_flush" and fit.flush.flushes == 1
    d = fit.to_dict()
    assert (d["batch"], d["batch_with_flush"], d["fit_state"]) == (4, 5, "fits_with_cache_flush")
    assert d["flush"]["reserved_bytes"] == 84_276_150_272


def test_nothing_runs_without_the_flush_gives_none_and_one(mistral):
    # S=3584: B=1 is over usable (84.95 GiB reserved) but runs with one flush (tests/test_fit_state.py)
    fit = trainmem.largest_micro_batch(mistral, step=StepSpec(seq=3584, precision="bf16"), gpu="H100-80GB")
    assert (fit.batch, fit.batch_with_flush, fit.fit_state) == (None, 1, "fits_with_cache_flush")


@pytest.mark.slow  # advise's ladder twice (B=5 and B=6) and two guarded steps: ~15 s of CPU
def test_a_run_that_needs_the_flush_is_not_stopped(mistral, caplog):
    """guard(on_oom="stop") raises only when the step does not run; the flush is a WARNING. The real loop
    is a tiny Llama; the check is made for Mistral-7B's spec (spec=), B=5, on H100-80GB."""
    torch = pytest.importorskip("torch")
    from integrations_tiny import LLAMA, tiny_llama
    model = tiny_llama()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
    ids = torch.randint(0, LLAMA["vocab_size"], (1, 16), generator=torch.Generator().manual_seed(0))

    def step():
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    with caplog.at_level(logging.INFO, logger="trainmem"):
        report = trainmem.guard(model, opt, step, batch=5, seq=1024, precision="bf16", spec=mistral, gpu="H100-80GB",
                                on_oom="stop", steps=1)
    assert report.check.fit_state == "fits_with_cache_flush" and report.measured is not None
    assert any("ONLY BY FLUSHING" in r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)
    with pytest.raises(trainmem.DoesNotFit) as info:
        trainmem.guard(model, opt, step, batch=6, seq=1024, precision="bf16", spec=mistral, gpu="H100-80GB",
                       on_oom="stop", steps=1)
    check = info.value.check
    assert (check.fit_state, check.fits, check.runs, check.flush) == ("does_not_fit", False, False, None)
