"""Every header names the settings that change the numbers (every-k's K, the framework), and ``explain``
names the memory figure of its peaks (issue 13 audit: report/text.py, report/plan_text.py)."""

from __future__ import annotations

from trainmem.estimate import estimate
from trainmem.plan.explain import explain
from trainmem.report.plan_text import _cfg, render_explanation
from trainmem.report.text import render_estimate
from trainmem.specs import ImplSpec, ModelSpec, StepSpec

MODEL = ModelSpec(hidden_size=64, num_layers=4, num_heads=4, ffn_size=128, vocab_size=256)
STEP = StepSpec(batch=1, seq=64)


def _header(impl: ImplSpec) -> str:
    return render_estimate(estimate(MODEL, STEP, impl)).splitlines()[2]


def test_estimate_header_names_k_and_framework():
    every = _header(ImplSpec(recompute="every-k", recompute_every=2))
    assert "recompute=every-k(K=2" in every and "framework=hf" in every
    assert "recompute=none " in _header(ImplSpec())
    assert "framework=litgpt" in _header(ImplSpec(framework="litgpt"))


def test_explain_names_k_framework_and_its_figure():
    text = render_explanation(explain(MODEL, STEP, ImplSpec(recompute="every-k", recompute_every=2)))
    head = " ".join(text.split("\n\n")[0].split())
    assert "recompute=every-k(K=2" in head and "framework=hf" in head
    assert "memory figure: allocated" in head


def test_plan_row_names_k():
    row = dict(micro_batch=1, grad_accum=2, attention="flash", recompute="every-k", recompute_every=4, tp=1, sp=False,
               cp=1, pp=1, dp=8, zero=3, offload=())
    assert "recompute=every-k(K=4)" in _cfg(row)
    assert "recompute=full " in _cfg({**row, "recompute": "full", "recompute_every": 1})
