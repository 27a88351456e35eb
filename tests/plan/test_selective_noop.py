"""Selective recompute with a fused attention kernel changes next to nothing: the estimate says
so (text and JSON), ``advise`` does not offer it, ``explain`` says so (issue 12, item 3)."""

from __future__ import annotations

import json

import pytest

from trainmem.cli import main
from trainmem.estimate import estimate
from trainmem.plan.advise import advise
from trainmem.plan.explain import explain
from trainmem.plan.hardware import load_gpu
from trainmem.report.plan_text import render_advice, render_explanation
from trainmem.report.text import render_estimate
from trainmem.specs import ImplSpec, StepSpec
from trainmem.specs.loaders import load_model

LLAMA3 = load_model("llama-3-8b")
GPT2 = load_model("gpt2")
NOOP = "changes next to nothing"


def test_estimate_notes_the_noop_and_its_bytes():
    step = StepSpec()  # B=1, S=4096, bf16: SDPA runs flash on CUDA
    e = estimate(LLAMA3, step, ImplSpec(recompute="selective"))
    plain = estimate(LLAMA3, step, ImplSpec())
    saved = plain.totals_bytes["activation"] - e.totals_bytes["activation"]
    # flash's log-sum-exp goes: B·A·S fp32 per layer = 1·32·4096·4 = 524,288 B × 32 layers; and the
    # checkpointed attention holds the position ids (1·S int64, one storage for every layer: they reach it
    # in **kwargs, 332370b), so 32,768 B come back
    assert saved == 32 * 1 * 32 * 4096 * 4 - 4096 * 8 == 16_744_448
    assert len(e.notes) == 1
    note = e.notes[0]
    assert NOOP in note and "selective" in note and "S×S" in note and "15.97 MiB" in note
    assert e.to_dict()["notes"] == [note]
    assert note in render_estimate(e)


@pytest.mark.parametrize("impl", [ImplSpec(attention="eager", recompute="selective"),
                                  ImplSpec(profile="megatron", attention="flash", recompute="selective"),
                                  ImplSpec(attention="flash", recompute="full"),
                                  ImplSpec(attention="flash")])
def test_no_note_where_selective_drops_a_score_matrix_or_is_not_asked(impl):
    e = estimate(LLAMA3, StepSpec(seq=1024), impl)
    assert e.notes == ()
    assert e.to_dict()["notes"] == []


def test_cli_estimate_says_so(capsys):
    assert main(["estimate", "--recompute", "selective"]) == 0
    assert NOOP in capsys.readouterr().out
    assert main(["estimate", "--recompute", "selective", "--json"]) == 0
    notes = json.loads(capsys.readouterr().out)["notes"]
    assert len(notes) == 1 and NOOP in notes[0]


@pytest.mark.parametrize("attention", ["eager", "flash"])
def test_advise_does_not_offer_a_noop(attention):
    step, impl = StepSpec(batch=8, seq=1024, precision="amp-bf16"), ImplSpec(attention=attention)
    a = advise(GPT2, step, impl, load_gpu("custom", memory_bytes=4 << 30, bf16_flops=1e14))
    assert "selective_recompute" not in {s.rung for s in a.steps}
    why = dict(a.skipped)["selective_recompute"]
    assert NOOP in why and "flash" in why, why
    assert a.fits and a.steps[-1].rung == "full_recompute"
    text = render_advice(a)
    assert "selective activation checkpointing" not in text and NOOP in text


def test_advise_keeps_selective_where_it_drops_the_scores():
    # the megatron profile materializes softmax and dropout (sbh·5as/h); selective drops them
    step, impl = StepSpec(batch=1, seq=2048), ImplSpec(profile="megatron", attention="flash")
    a = advise(load_model("llama-2-7b"), step, impl, load_gpu("custom", memory_bytes=60 << 30, bf16_flops=1e15))
    sel = next(s for s in a.steps if s.rung == "selective_recompute")
    assert sel.saved_bytes > 2**30


def test_explain_says_so():
    ex = explain(GPT2, StepSpec(seq=512), ImplSpec(attention="flash", recompute="selective"))
    assert len(ex.notes) == 1 and NOOP in ex.notes[0]
    assert ex.to_dict()["notes"] == list(ex.notes)
    assert ex.notes[0] in render_explanation(ex)
    eager = explain(GPT2, StepSpec(seq=512), ImplSpec(attention="eager", recompute="selective"))
    assert eager.notes == () and NOOP not in render_explanation(eager)
