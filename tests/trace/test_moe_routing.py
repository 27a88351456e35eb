"""MoE routing under an explicit assumption: concrete expert-token counts on fake tensors."""

import json

import pytest
import torch

from tiny_families import FAMILIES
from trainmem.cli import main
from trainmem.errors import SpecError
from trainmem.specs import ImplSpec, StepSpec
from trainmem.specs.impl import routing_hot_fraction
from trainmem.trace import trace_step
from trainmem.trace.routing import force_routing, tokens_per_expert

QWEN3_MOE = FAMILIES["qwen3_moe"]  # 4 experts, top-2, hidden 64, 2 layers
FP32 = StepSpec(batch=2, seq=64, precision="fp32")


def test_tokens_per_expert_is_exact():
    # balanced: 8 tokens · 2 choices = 16 over 4 experts = 4 each
    assert tokens_per_expert(8, 4, 2, 0.0) == (4, 4, 4, 4)
    # 5 tokens · 2 = 10 over 3 experts: 10 = 4 + 3 + 3, the remainder to the first
    assert tokens_per_expert(5, 3, 2, 0.0) == (4, 3, 3)
    # worst: all 8 tokens choose experts 0 and 1
    assert tokens_per_expert(8, 4, 2, 1.0) == (8, 8, 0, 0)
    # skewed:0.5: 4 tokens to experts 0 and 1 (4 each), the other 4 · 2 = 8 balanced (2 each)
    assert tokens_per_expert(8, 4, 2, 0.5) == (6, 6, 2, 2)


@pytest.mark.parametrize("tokens, k, experts, hot", [(16, 2, 4, 0.0), (16, 2, 4, 0.5), (16, 2, 4, 1.0),
                                                     (13, 8, 16, 0.25), (7, 3, 5, 0.3)])
def test_compiled_ids_are_the_same_assignment(tokens, k, experts, hot):
    """Under compile the ids come from the block's own router ids (trace/routing.py _derived_index): the
    same ids, whatever the router chose."""
    from trainmem.trace.routing import _derived_index, _forced_index

    like = torch.randint(0, experts, (tokens, k))
    ids = _derived_index(like, experts, hot)
    assert torch.equal(ids, _forced_index(like, experts, hot))
    assert tuple(torch.bincount(ids.reshape(-1), minlength=experts).tolist()) == tokens_per_expert(tokens, experts, k, hot)


def test_routing_values_are_validated():
    assert routing_hot_fraction("balanced") == 0.0
    assert routing_hot_fraction("worst") == 1.0
    assert routing_hot_fraction("skewed:0.25") == 0.25
    for bad in ("skewed:1.5", "skewed:", "skewed:-0.1", "skewed:nan", "uniform", 3):
        with pytest.raises(SpecError, match="routing"):
            ImplSpec(routing=bad)


@pytest.mark.parametrize("hot", [0.0, 0.5, 1.0])
def test_the_forced_assignment_reaches_the_experts(hot):
    from trainmem.models.hf import build_hf_model

    torch.manual_seed(0)
    model = build_hf_model(QWEN3_MOE)
    seen = []
    with force_routing(model, hot) as n:
        for m in model.modules():
            if type(m).__name__ == "Qwen3MoeExperts":
                m.register_forward_hook(lambda mod, args, out: seen.append(args[1]))
        model(torch.randint(0, 512, (2, 8)))
    assert n == 2 and len(seen) == 2
    for index in seen:  # 2 · 8 = 16 tokens, top-2 of 4 experts
        assert tuple(torch.bincount(index.reshape(-1), minlength=4).tolist()) == tokens_per_expert(16, 4, 2, hot)
        assert all(len(set(row)) == 2 for row in index.tolist())  # a token's k choices are distinct


@pytest.mark.slow  # ~3 s on CI's two cores (6.4 s on the loaded shared machine)
def test_per_expert_loop_runs_on_fake_tensors_and_matches_real_to_the_byte():
    impl = ImplSpec(routing="worst")
    fake = trace_step(QWEN3_MOE, FP32, impl, experts="eager")
    real = trace_step(QWEN3_MOE, FP32, impl, experts="eager", real=True)
    assert fake.meta["fake"] and not real.meta["fake"]
    assert fake.peak_bytes == real.peak_bytes
    assert fake.totals_at_peak_bytes == real.totals_at_peak_bytes
    assert fake.meta["moe"] == {"routing": "worst", "experts_implementation": "eager", "num_experts": 4,
                                "top_k": 2, "experts_modules": 2}


@pytest.mark.slow
@pytest.mark.parametrize("experts,precision", [("eager", "fp32"), ("eager", "bf16"), ("grouped_mm", "fp32"),
                                               ("grouped_mm", "bf16"), ("batched_mm", "fp32")])
@pytest.mark.parametrize("routing", ["balanced", "skewed:0.25", "worst"])
def test_fake_equals_real_for_every_routing(experts, precision, routing):
    step, impl = StepSpec(batch=2, seq=64, precision=precision), ImplSpec(routing=routing)
    fake = trace_step(QWEN3_MOE, step, impl, experts=experts)
    real = trace_step(QWEN3_MOE, step, impl, experts=experts, real=True)
    assert (fake.peak_bytes, fake.totals_at_peak_bytes) == (real.peak_bytes, real.totals_at_peak_bytes)


@pytest.mark.slow  # 10-30 s on 2 shared cores: the default run is at its 10-minute budget
def test_grouped_mm_memory_does_not_depend_on_routing_the_loop_does():
    """grouped_mm's tensors all have tokens·k rows (transformers/integrations/moe.py,
    grouped_mm_experts_forward); the per-expert loop allocates per expert hit."""
    bf16 = StepSpec(batch=2, seq=64, precision="bf16")
    grouped = {r: trace_step(QWEN3_MOE, bf16, ImplSpec(routing=r)).peak_bytes for r in ("balanced", "worst")}
    assert grouped["balanced"] == grouped["worst"]
    loop = {r: trace_step(QWEN3_MOE, bf16, ImplSpec(routing=r), experts="eager").peak_bytes
            for r in ("balanced", "worst")}
    assert loop["balanced"] != loop["worst"]


@pytest.mark.slow  # ~4 s on CI's two cores
def test_cli_states_the_routing_assumption(tmp_path, capsys):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(QWEN3_MOE))
    base = ["trace", "--model", str(path), "--batch", "2", "--seq", "32", "--progress", "never"]
    assert main([*base, "--routing", "skewed:0.5", "--experts", "eager"]) == 0
    out = capsys.readouterr().out
    assert ("MoE routing: skewed:0.5 (assumed, not measured), experts_implementation=eager, 4 experts, top-2, "
            "in 2 layers") in out
    assert main([*base, "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["meta"]["moe"]["routing"] == d["inputs"]["impl"]["routing"] == "balanced"
    assert main([*base, "--routing", "hot"]) == 2
    assert capsys.readouterr().err.strip() == ("SpecError: routing='hot': must be balanced, worst or skewed:F "
                                               "with F in [0, 1]")


def test_estimate_takes_the_same_switch():
    """The estimator models grouped_mm experts (rules_hf_moe.py ``_moe``): its memory does not depend
    on routing on one device; expert-parallel ranks under uneven routing are not modelled."""
    from trainmem.estimate import estimate
    from trainmem.specs import ParallelSpec
    from trainmem.specs.loaders import load_model

    model, step = load_model("mixtral-8x7b"), StepSpec(batch=1, seq=512)
    peaks = {r: estimate(model, step, ImplSpec(routing=r)).peak_bytes for r in ("balanced", "skewed:0.5", "worst")}
    assert len(set(peaks.values())) == 1
    with pytest.raises(SpecError, match="routing='worst': is not modelled with ep=2"):
        estimate(model, step, ImplSpec(routing="worst"), ParallelSpec(dp=2, ep=2))
    assert estimate(model, step, ImplSpec(), ParallelSpec(dp=2, ep=2)).peak_bytes > 0
