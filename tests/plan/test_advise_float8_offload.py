"""advise offers Float8 with --compile (per block) and with TP, where the estimator accepts the
combination, and still searches when only FSDP CPU offload can hold the weights (issue 13)."""

from __future__ import annotations

import json
import shlex
from dataclasses import replace

from trainmem.cli import main
from trainmem.estimate import estimate
from trainmem.plan.advise import _Clock, _Measure, search
from trainmem.plan.choices import CHOICES, Config, Context
from trainmem.plan.cost import CostModel, matmul_parameters
from trainmem.plan.hardware import Reserve, load_gpu
from trainmem.specs import ImplSpec, ParallelSpec, StepSpec
from trainmem.specs.loaders import load_model

LLAMA3 = load_model("llama-3-8b")
H100 = load_gpu("h100-80gb")
FP8 = Context(model=LLAMA3, gpus=2, gpus_per_node=8, fp8=True)


def _variants(name: str, c: Config, ctx: Context = FP8) -> dict[str, Config]:
    return {what: new for new, what in CHOICES[name].variants(c, ctx)}


def test_float8_with_compile_is_per_block_and_the_estimators(capsys):
    # a whole-model compile: Float8 comes with a per-block compile, the only scope its compiled rules cover
    start = Config(StepSpec(seq=2048), ImplSpec(compile=True), ParallelSpec())
    got = _variants("float8", start, replace(FP8, gpus=1))
    assert sorted(got) == ["Float8 linears, rowwise (compiled per block)",
                           "Float8 linears, tensorwise (compiled per block)"]
    measure = _Measure(LLAMA3)
    for c in got.values():
        assert c.impl.compile and c.impl.compile_scope == "block"
        assert measure(c) is not None  # the estimator accepts it
    # compile on top of Float8: per block too (a whole-model compile of Float8 is refused)
    f8 = replace(start, impl=ImplSpec(float8="rowwise"))
    (compiled, what), = CHOICES["compile"].variants(f8, FP8)
    assert what == "torch.compile per block" and compiled.impl.compile_scope == "block"
    assert measure(compiled) is not None and measure(replace(compiled, impl=replace(compiled.impl, compile_scope="model"))) is None
    e = estimate(LLAMA3, compiled.step, compiled.impl)
    assert main(shlex.split(compiled.command("llama-3-8b"))[1:] + ["--json"]) == 0
    assert json.loads(capsys.readouterr().out)["peak_bytes"] == e.peak_bytes == measure(compiled)[0]


def test_float8_under_tp_follows_the_styles():
    # tensorwise's Float8 TP styles need SP (torchtitan's plan); rowwise takes the plain styles
    sp = Config(StepSpec(seq=4096), ImplSpec(), ParallelSpec(tp=2, sp=True))
    assert sorted(_variants("float8", sp)) == ["Float8 linears, rowwise", "Float8 linears, tensorwise"]
    no_sp = replace(sp, par=ParallelSpec(tp=2))
    # tensorwise without SP comes with SP turned on, one change (tests/plan/test_advise_float8_sp.py)
    assert sorted(_variants("float8", no_sp)) == ["Float8 linears, rowwise",
                                                  "Float8 linears, tensorwise with sequence parallelism"]
    assert _Measure(LLAMA3)(_variants("float8", no_sp)["Float8 linears, rowwise"]) is not None


def test_float8_tp_option_has_the_estimators_memory_and_fp8_speed():
    """Llama-3-8B S=4096 bf16 on TP2+SP: tensorwise keeps the fp8 gathered inputs (40871629836 B
    allocated, 42616459788 B without, each with the 4-byte loss value item of 8a4b7d1 and loss_parallel's fused
    backward rows, 4096·41 + 4 = 167,940 B, of e4e29f0); with the
    usable memory between the two, it is the cheapest
    fit, priced at the FP8 rate as the Float8 choice always is (faster than the start)."""
    start = Config(StepSpec(seq=4096), ImplSpec(), ParallelSpec(tp=2, sp=True))
    tw = _variants("float8", start)["Float8 linears, tensorwise"]
    measure = _Measure(LLAMA3)
    assert measure(start)[0] == 42616459788 and measure(tw)[0] == 40871629836
    usable = measure.reserved(tw)
    assert measure.reserved(start) > usable
    options, _ = search(LLAMA3, start, H100, usable, gpus=2, budget=8, max_changes=1, top=1, top_changing=0,
                        measure=measure)
    best = options[0]
    assert best.changes == ("float8",) and best.actions == ("Float8 linears, tensorwise",)
    assert best.peak_bytes == 40871629836 and best.reserved_bytes == usable
    clock = _Clock(LLAMA3, start, H100, CostModel())
    assert best.throughput_cost == clock.throughput_cost(tw) < 0
    assert "--float8 tensorwise" in best.command and "--tp 2 --sp" in best.command


def test_float8_the_estimator_refuses_is_never_offered():
    # amp-bf16 under TP: the Float8 TP styles are modelled in pure precisions only
    start = Config(StepSpec(seq=4096, precision="amp-bf16"), ImplSpec(), ParallelSpec(tp=2, sp=True))
    measure = _Measure(LLAMA3)
    usable = (measure(start) and measure.reserved(start)) - 1
    options, stats = search(LLAMA3, start, H100, usable, gpus=2, budget=6, max_changes=1, top=1,
                                 top_changing=0, measure=measure)
    assert stats.tried.get("float8") == 2  # priced fastest, measured first, refused
    assert all(c.impl.float8 != "none" for c in measure.failed) and len(measure.failed) == 2
    assert options and not any("float8" in o.changes for o in options)


def test_only_fsdp_cpu_offload_fits_past_the_4bit_floor():
    """GPT-3 175B on two L4s: even 4-bit weights over both (40.65 GiB per GPU) exceed the usable
    21.24 GiB, but FSDP with CPUOffloadPolicy keeps the shards in host memory: one option."""
    model, gpu = load_model("gpt3-175b"), load_gpu("l4")
    usable = Reserve.modelled(gpu).reserved_usable_bytes(gpu, 2)
    assert matmul_parameters(model)[1] // 2 // 2 > usable
    start = Config(StepSpec(seq=1024), ImplSpec(recompute="full"), ParallelSpec(dp=2))
    options, stats = search(model, start, gpu, usable, gpus=2, budget=8, max_changes=2, top=1,
                             top_changing=0, model_name="gpt3-175b")
    assert stats.why == "" and stats.complete
    (o,) = options
    assert o.changes == ("shard", "fsdp_cpu_offload") and o.config["offload"] == ["params"]
    assert o.reserved_bytes <= usable and o.throughput_cost > 0  # PCIe and a CPU Adam
    e = estimate(model, start.step, start.impl, ParallelSpec(dp=2, fsdp="full", offload=("params",)))
    assert o.peak_bytes == e.peak_bytes
    assert o.command.endswith("--dp 2 --fsdp full --offload params")
