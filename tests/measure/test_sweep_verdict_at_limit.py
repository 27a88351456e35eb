"""The sweep's verdict describes growth at the limit it found, not averaged over the range
(issue 12, item 5)."""

from __future__ import annotations

import json

import pytest

from trainmem.cli import main
from trainmem.measure.sweeps import sweep
from trainmem.specs import ImplSpec, StepSpec
from trainmem.specs.loaders import load_model

LLAMA2 = load_model("llama-2-7b")
EAGER = ImplSpec(attention="eager")
# the largest seq within 80 GiB: the forward phase tops the step there, with the DynamicCache's K copies that no
# node saves (eager matmul saves its own reshaped copy of K^T; estimate/forward_held.py), 32 layers x 4096 x 2 B
# per token beside the activations (2240 before they were counted)
LIMIT = 2176


def _issue_sweep():
    # trainmem sweep --over seq --budget 80GiB --backend estimate --model llama-2-7b --attention eager
    return sweep(LLAMA2, StepSpec(batch=1, precision="bf16"), EAGER, over="seq", budget_bytes=80 * 2**30)


def test_quadratic_at_the_limit_though_linear_over_the_range():
    r = _issue_sweep()
    assert r.max_fit == LIMIT
    assert r.fit["ledgers"]["activation"]["exponent"] < 1.5  # the range average: mostly below the crossover
    assert r.crossover_seq == pytest.approx(997, abs=1)      # 6.125e6 B/token ÷ 6144 B/token² (kept)
    limit = {p.value: p for p in r.points}[LIMIT]
    scores, rest = limit.terms_bytes["attention_scores"], limit.terms_bytes["other_activations"]
    # the estimator's own items at S=2176: scores 6144·S² = 29,091,233,792 B; the rest linear in S (+ a few)
    assert scores == 6144 * LIMIT**2
    share = scores / (scores + rest)
    assert r.at_limit["value"] == LIMIT
    assert r.at_limit["quadratic_share"] == pytest.approx(share, rel=1e-12)
    assert 0.68 < share < 0.71
    # y = a·S² + b·S: d ln y / d ln S = (2a·S² + b·S)/(a·S² + b·S) = 1 + share
    assert r.at_limit["exponent"] == pytest.approx(1 + share, abs=2e-3)
    assert r.verdict == "quadratic"


def test_linear_at_the_limit_when_no_score_matrix():
    r = sweep(LLAMA2, StepSpec(batch=1, precision="bf16"), ImplSpec(attention="flash"), over="seq",
              budget_bytes=80 * 2**30)
    assert r.at_limit["value"] == r.max_fit
    assert r.at_limit["quadratic_share"] == 0
    assert r.at_limit["exponent"] == pytest.approx(1.0, abs=0.01)
    assert r.verdict == "linear" and r.crossover_seq is None


def test_over_batch_is_linear_at_the_limit():
    r = sweep(LLAMA2, StepSpec(seq=2048, precision="bf16"), EAGER, over="batch", budget_bytes=120 * 2**30)
    assert r.at_limit["value"] == r.max_fit > 1
    assert r.at_limit["exponent"] == pytest.approx(1.0, abs=0.01)
    assert r.at_limit["quadratic_share"] == pytest.approx(0.0, abs=1e-6)  # nothing grows as B²
    assert r.verdict == "linear"


def test_text_and_json_describe_the_limit(capsys):
    argv = ["sweep", "--over", "seq", "--budget", "80GiB", "--backend", "estimate", "--model", "llama-2-7b",
            "--attention", "eager"]
    assert main(argv) == 0
    text = capsys.readouterr().out
    r = _issue_sweep()
    share, exponent = r.at_limit["quadratic_share"], r.at_limit["exponent"]
    assert f"verdict: quadratic at seq={LIMIT} (quadratic share {share:.0%}, local exponent {exponent:.2f})" in text
    assert "overtakes the linear terms at: S ≈ 997" in text
    assert main([*argv, "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["verdict"] == "quadratic"
    assert d["at_limit"]["value"] == LIMIT and d["at_limit"]["quadratic_share"] == pytest.approx(share)
    assert d["at_limit"]["exponent"] == pytest.approx(exponent, abs=1e-6)
    assert d["crossover_seq"] == pytest.approx(997, abs=1)
