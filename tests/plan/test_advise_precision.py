"""advise's precision choices (issue 13): fp32 → amp-bf16 / mixed-bf16 (and fsdp-bf16, FSDP2's
MixedPrecisionPolicy, from an FSDP start); fp32 or a mixed recipe → pure bf16 with its caveat in the
action's words. Each variant's peak is the estimator's, the printed estimate line reproduces it to the
byte, and the step time is the cost model's: no bf16 matmul term, so fp32 → a 16-bit recipe on one
device costs exactly 0 and the action says the speed-up is unpriced."""

from __future__ import annotations

import json

from trainmem.cli import main
from trainmem.estimate import estimate
from trainmem.plan.advise import _Clock, advise
from trainmem.plan.choices import CHOICES, Config, Context
from trainmem.plan.cost import CostModel
from trainmem.plan.hardware import load_gpu
from trainmem.specs import ImplSpec, ParallelSpec, StepSpec
from trainmem.specs.loaders import load_model

GPT2 = load_model("gpt2")


def _variants(start: Config, gpus: int) -> dict[str, Config]:
    ctx = Context(GPT2, gpus, 8)
    return {what: c for name in ("precision", "pure_bf16") for c, what in CHOICES[name].variants(start, ctx)}


def _peak(c: Config) -> int:
    return estimate(GPT2, c.step, c.impl, None if c.par.is_single else c.par).peak_bytes


def test_fsdp_start_offers_fsdp_bf16_and_every_line_reproduces_the_peak(capsys):
    start = Config(StepSpec(batch=2, seq=512, precision="fp32"), ImplSpec(attention="sdpa"),
                   ParallelSpec(dp=2, fsdp="full"))
    got = _variants(start, 2)
    assert sorted(c.step.precision for c in got.values()) == ["amp-bf16", "bf16", "fsdp-bf16", "mixed-bf16"]
    for what, c in got.items():
        assert main(c.command("gpt2").split()[1:] + ["--json"]) == 0
        assert json.loads(capsys.readouterr().out)["peak_bytes"] == _peak(c), what
        assert "unpriced" in what, what  # from fp32 every recipe gains the bf16 matmul rate the model lacks
    assert "lose precision" in next(w for w, c in got.items() if c.step.precision == "bf16")
    # FSDP2's policy: fp32 shards gathered in bf16, below the pure-fp32 FSDP peak
    fsdp_bf16 = next(c for c in got.values() if c.step.precision == "fsdp-bf16")
    assert _peak(fsdp_bf16) < _peak(start)


def test_where_precision_is_not_offered():
    one = Config(StepSpec(batch=1, seq=512, precision="fp32"), ImplSpec(attention="sdpa"), ParallelSpec())
    assert "fsdp-bf16" not in {c.step.precision for c in _variants(one, 1).values()}  # needs FSDP2
    fsdp1 = Config(one.step, one.impl, ParallelSpec(dp=2, fsdp="full", fsdp_version=1))
    assert "fsdp-bf16" not in {c.step.precision for c in _variants(fsdp1, 2).values()}
    amp = Config(StepSpec(batch=1, seq=512, precision="amp-bf16"), one.impl, one.par)
    assert [c.step.precision for c in _variants(amp, 1).values()] == ["bf16"]
    assert not _variants(Config(StepSpec(batch=1, seq=512), one.impl, one.par), 1)  # already pure bf16


def test_advise_offers_pure_bf16_with_its_caveat_priced_by_the_cost_model(capsys):
    # gpt2 fp32 B1 S1024 sdpa: 3.05 GiB allocated; pure bf16 1.82 GiB, the only single change under 2 GiB usable
    step, impl = StepSpec(batch=1, seq=1024, precision="fp32"), ImplSpec(attention="sdpa")
    gpu = load_gpu("l4", memory_bytes=3 << 30)
    a = advise(GPT2, step, impl, gpu, max_changes=1, model_name="gpt2")
    o = next(o for o in a.options if o.changes == ("pure_bf16",))
    assert "lose precision" in o.actions[0] and "unpriced" in o.actions[0]
    start = Config(step, impl, ParallelSpec())
    bf16 = _variants(start, 1)[o.actions[0]]
    assert o.peak_bytes == _peak(bf16)
    assert o.throughput_cost == _Clock(GPT2, start, gpu, CostModel()).throughput_cost(bf16) == 0.0
    assert main(o.command.split()[1:] + ["--json"]) == 0
    assert json.loads(capsys.readouterr().out)["peak_bytes"] == o.peak_bytes
