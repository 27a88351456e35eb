"""``advise`` says "faster" or "slower" in words; the JSON keeps the signed share and states its
sign (issue 12, item 9)."""

from __future__ import annotations

import json

from trainmem.cli import main
from trainmem.plan.advise import advise
from trainmem.plan.hardware import load_gpu
from trainmem.report.plan_text import render_advice
from trainmem.specs import ImplSpec, StepSpec
from trainmem.specs.loaders import load_model

GPT2 = load_model("gpt2")


def _advice():
    # eager → flash makes the step faster (eager's score FLOPs run slower in the cost model);
    # a smaller micro-batch and checkpointing make it slower: both signs on one ladder
    step, impl = StepSpec(batch=8, seq=1024), ImplSpec(attention="eager")
    return advise(GPT2, step, impl, load_gpu("custom", memory_bytes=3 << 30, bf16_flops=1e14))


def test_both_directions_in_words():
    a = _advice()
    costs = {s.rung: s.throughput_cost for s in a.steps}
    assert costs["attention"] < 0 < max(costs.values()), costs
    text = render_advice(a)
    for s in a.steps:
        c = s.throughput_cost
        said = "same speed" if round(abs(c), 2) == 0 else f"{abs(c):.0%} {'faster' if c < 0 else 'slower'}"
        assert said in text, (s.rung, text)
    assert "faster" in text and "slower" in text
    assert "throughput cost -" not in text and "cost +" not in text


def test_json_keeps_the_signed_share_and_states_its_sign(capsys):
    assert main(["advise", "--model", "gpt2", "--batch", "8", "--seq", "1024", "--attention", "eager",
                 "--precision", "amp-bf16", "--gpu", "custom", "--gpu-memory", "3GiB", "--gpu-tflops", "100",
                 "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["steps"][0]["rung"] == "attention" and d["steps"][0]["throughput_cost"] < 0
    sign = d["conventions"]["throughput_cost"]
    assert "negative" in sign and "faster" in sign and "tokens_per_s" in sign
