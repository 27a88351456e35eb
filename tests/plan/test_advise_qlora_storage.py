"""advise's QLoRA storage choice (issue 13, mechanism 7): from a QLoRA start it offers 4-bit storage
for every frozen linear (scope all), double quantization and a 4-bit output head, each with the
estimator's peak; and every command line advise prints carries the QLoRA/adapter flags, so it
reproduces that peak (it used to drop --qlora-scope, --no-double-quant, --quantize-head, --quant-impl)."""

from __future__ import annotations

import json
from dataclasses import replace

from trainmem.cli import main
from trainmem.estimate import estimate
from trainmem.plan.choices import CHOICES, Config, Context
from trainmem.specs import ImplSpec, ParallelSpec, StepSpec
from trainmem.specs.finetune import FinetuneSpec
from trainmem.specs.loaders import load_model

MODEL = load_model("llama-3-8b")
START = Config(StepSpec(batch=1, seq=1024), ImplSpec(), ParallelSpec(),
               FinetuneSpec(mode="qlora", lora_targets=("q_proj", "v_proj"), qlora_scope="targeted",
                            double_quant=False, lora_dropout=0.1))


def _cli_peak(command: str, capsys) -> int:
    assert main(command.split()[1:] + ["--json"]) == 0
    return json.loads(capsys.readouterr().out)["peak_bytes"]


def test_variants_lower_the_estimators_peak_and_their_lines_reproduce_it(capsys):
    variants = dict((what, c) for c, what in CHOICES["qlora_storage"].variants(START, Context(MODEL, 1, 8)))
    assert set(variants) == {"QLoRA: every frozen linear in 4 bits (scope all)", "QLoRA: double quantization",
                             "QLoRA: 4-bit output head"}
    start_peak = estimate(MODEL, START.step, START.impl, finetune=START.finetune).peak_bytes
    assert _cli_peak(START.command("llama-3-8b"), capsys) == start_peak
    for what, c in variants.items():
        peak = estimate(MODEL, c.step, c.impl, finetune=c.finetune).peak_bytes
        assert peak < start_peak, what
        assert _cli_peak(c.command("llama-3-8b"), capsys) == peak, what


def test_nothing_to_offer_outside_qlora_or_when_already_smallest():
    ctx = Context(MODEL, 1, 8)
    smallest = replace(START, finetune=replace(START.finetune, qlora_scope="all", double_quant=True, quantize_head=True))
    lora = replace(START, finetune=FinetuneSpec(mode="lora"))
    assert not list(CHOICES["qlora_storage"].variants(smallest, ctx))
    assert not list(CHOICES["qlora_storage"].variants(lora, ctx))
    tied = Context(replace(MODEL, tied_embeddings=True), 1, 8)  # the estimator refuses a tied 4-bit head
    assert "QLoRA: 4-bit output head" not in {w for _, w in CHOICES["qlora_storage"].variants(START, tied)}
