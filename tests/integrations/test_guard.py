"""trainmem.guard on a plain PyTorch loop (tiny Llama h64/L2/V1000 on CPU).

Measured agreement on this project's CPU machine: B=2, S=64, fp32, foreach AdamW,
measured ÷ predicted = 0.9997 over 2 steps (5,769,628 of 5,771,524 bytes).
"""

import logging

import pytest

torch = pytest.importorskip("torch")

from integrations_tiny import LLAMA, tiny_llama  # noqa: E402

import trainmem  # noqa: E402
from trainmem.errors import SpecError, UnsupportedError  # noqa: E402
from trainmem.integrations import DoesNotFit, GuardReport  # noqa: E402
from trainmem.specs import ImplSpec  # noqa: E402
from trainmem.specs.loaders import spec_from_hf_config  # noqa: E402

TOLERANCE = 0.01


def _loop(model, batch=2, seq=64):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
    ids = torch.randint(0, LLAMA["vocab_size"], (batch, seq), generator=torch.Generator().manual_seed(0))
    calls = []

    def step():
        calls.append(1)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return opt, step, calls


def test_guard_checks_then_measures(caplog):
    model = tiny_llama()
    opt, step, calls = _loop(model)
    with caplog.at_level(logging.INFO, logger="trainmem"):
        report = trainmem.guard(model, opt, step, batch=2, seq=64, gpu="A100-40GB")
    assert isinstance(report, GuardReport) and len(calls) == 2
    run = report.check.run
    assert (run.step.batch, run.step.seq, run.step.precision, run.step.optimizer) == (2, 64, "fp32", "adamw")
    assert report.check.fits is True
    assert len(report.measured.step_peaks_bytes) == 2
    assert abs(report.ratio - 1) <= TOLERANCE, f"measured/predicted = {report.ratio:.4f}"
    assert report.agrees is True
    assert "predicted peak" in caplog.text and "measured/predicted" in caplog.text
    assert any("autocast inside step_fn is not visible" in n for n in run.notes)  # fp32 read, said so
    assert report.to_dict()["measured"]["peak_bytes"] == report.measured.peak_bytes


def test_guard_stops_before_the_step_runs():
    model = tiny_llama("eager")
    opt, step, calls = _loop(model, batch=8, seq=256)
    with pytest.raises(DoesNotFit) as info:
        # 1.02 GiB less the 1 GiB reserve and 5%: nothing fits
        trainmem.guard(model, opt, step, batch=8, seq=256, gpu_memory="1.02GiB", on_oom="stop")
    assert calls == []
    assert info.value.check.fits is False
    assert "does NOT fit" in str(info.value)


def test_guard_on_a_module_without_config_needs_a_spec():
    model = tiny_llama()
    spec = spec_from_hf_config(LLAMA, name="tiny")
    inner = torch.nn.Sequential(model)  # a plain module: no Hugging Face config
    opt, step, _ = _loop(model)
    with pytest.raises(UnsupportedError, match="spec="):
        trainmem.guard(inner, opt, step, batch=2, seq=64, gpu="A100-40GB")
    report = trainmem.guard(inner, opt, step, batch=2, seq=64, spec=spec, impl=ImplSpec(device="cpu"),
                            gpu="A100-40GB", steps=1)
    assert len(report.measured.step_peaks_bytes) == 1


def test_guard_bad_options():
    model = tiny_llama()
    opt, step, calls = _loop(model)
    for kw, field in [(dict(on_oom="boom"), "on_oom"), (dict(steps=0), "steps"), (dict(reserve="1GiB"), "reserve"),
                      (dict(gpu_memory="-3GiB"), "gpu_memory"), (dict(precision="fp64"), "precision")]:
        with pytest.raises(SpecError) as info:
            trainmem.guard(model, opt, step, batch=2, seq=64, **kw)
        assert info.value.field == field
    assert calls == []


def test_disagreement_beyond_the_tolerance_is_a_warning(caplog):
    model = tiny_llama()
    opt, step, _ = _loop(model)
    with caplog.at_level(logging.INFO, logger="trainmem"):
        # tolerance 0: the ~2 KB the meter does not see (the input batch, made before the step) is too much
        report = trainmem.guard(model, opt, step, batch=2, seq=64, gpu="A100-40GB", tolerance=0.0, steps=2)
    assert report.ratio != 1 and report.agrees is False
    (line,) = [r.getMessage() for r in caplog.records if "measured/predicted" in r.getMessage()]
    assert "OUTSIDE the 0% tolerance" in line
    assert [r.levelno for r in caplog.records if "measured/predicted" in r.getMessage()] == [logging.WARNING]
