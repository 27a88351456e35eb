"""plan, advise and sweep decide fit with estimate's figures: the reserved peak from the allocator
model (estimate/allocation_order.py) against capacity − context (− NCCL beyond one rank), the same
verdict as ``estimate --memory-figure reserved`` / ``device``, no flat 5% share.

Boundary cases on H100-80GB (bf16, AdamW, B=1; measured with this code):
  - Mistral-7B S=4800: 74.49 GiB allocated (the loss's forward, the DynamicCache's K/V copies included:
    estimate/forward_held.py; S=4864 was the case before, 74.97 GiB with them) fits the old flat budget
    (80 GiB − 1 GiB − 5% = 74.67 GiB), but the model's reserved peak is 81.39 GiB > 78.65 GiB usable: no fit.
  - Llama-3-8B S=8192, full recompute: 74.79 GiB allocated (the optimizer step) is over the flat
    budget, the reserved peak 75.29 GiB fits 78.65 GiB.
"""

from __future__ import annotations

import json

import pytest

from trainmem.cli import main
from trainmem.estimate import estimate
from trainmem.estimate.allocation_order import estimate_reserved
from trainmem.plan.advise import advise
from trainmem.plan.hardware import Reserve, load_gpu
from trainmem.plan.search import SearchSpace, plan
from trainmem.specs import ImplSpec, StepSpec
from trainmem.specs.loaders import load_model

GIB = 1 << 30
H100 = load_gpu("H100-80GB")
FLAT = Reserve(fixed_bytes=GIB, fraction=0.05).usable_bytes(H100)  # the old flat budget, allocated bytes

# (model, seq, attention, recompute, figure asked of estimate, flat 5% verdict, allocator-model verdict)
CASES = [("mistral-7b", 4800, "mem-efficient", "none", "reserved", True, False),
         ("llama-3-8b", 8192, "flash", "full", "device", False, True)]


def _one(attn: str, rc: str) -> SearchSpace:
    """A search space holding one configuration: ``attn``, ``rc``, one GPU, micro-batch 1."""
    return SearchSpace(attention=(attn,), recompute=(rc,), tp=(1,), cp=(1,), pp=(1,), zero=(0,), offload=((),),
                       sp=(False,), max_micro_batch=1)


def _estimate_verdict(capsys, model: str, seq: int, attn: str, rc: str, figure: str) -> dict:
    assert main(["estimate", "--model", model, "--seq", str(seq), "--batch", "1", "--precision", "bf16",
                 "--attention", attn, "--recompute", rc, "--gpu", "H100-80GB", "--memory-figure", figure,
                 "--json"]) == 0
    return json.loads(capsys.readouterr().out)["fits"]


@pytest.mark.parametrize("model, seq, attn, rc, figure, flat, fits", CASES)
def test_plan_verdict_is_estimates_at_the_boundary(capsys, model, seq, attn, rc, figure, flat, fits):
    p = plan(load_model(model), seq=seq, global_batch=1, gpu=H100, gpus=1, space=_one(attn, rc), front=False)
    (c,) = p.candidates
    v = _estimate_verdict(capsys, model, seq, attn, rc, figure)
    assert (c.peak_bytes <= FLAT) is flat  # what the flat 5% said
    assert c.fits is v["fits"] is fits  # what plan and estimate say now
    assert c.peak_bytes == v["allocated_bytes"] and c.reserved_bytes == v["reserved_bytes"]
    # plan's usable is the reserved figure's: capacity − context, exactly
    assert p.usable_bytes == v["capacity_bytes"] - v["context_bytes"] == H100.memory_bytes - H100.context_bytes
    d = c.to_dict()
    assert d["memory_figure"] == "reserved" and d["peak_reserved_bytes"] == c.reserved_bytes


def test_advise_start_verdict_is_estimates():
    """Llama-3-8B S=8192 with full recompute: the flat 5% called for changes; it fits as it is."""
    step, impl = StepSpec(batch=1, seq=8192, precision="bf16"), ImplSpec(attention="flash", recompute="full")
    a = advise(load_model("llama-3-8b"), step, impl, H100, budget=4)
    e = estimate(load_model("llama-3-8b"), step, impl)
    assert a.start_peak_bytes == e.peak_bytes > FLAT
    assert a.start_reserved_bytes == estimate_reserved(e).reserved_bytes <= a.usable_bytes == H100.memory_bytes - H100.context_bytes
    assert a.fits and not a.steps and not a.options
    d = a.to_dict()
    assert d["memory_figure"] == {"figure": "reserved", "peak_reserved_bytes": a.start_reserved_bytes}


def test_reserve_fraction_is_an_extra_margin():
    """``--reserve-fraction`` stays: an explicit margin taken off the reserved budget (default 0)."""
    assert Reserve.modelled(H100).reserved_usable_bytes(H100) == H100.memory_bytes - H100.context_bytes
    assert Reserve.modelled(H100, 0.05).reserved_usable_bytes(H100, 8) == \
        H100.memory_bytes - H100.context_bytes - (256 << 20) - int(0.05 * H100.memory_bytes)
    from trainmem.cli import build_parser
    for cmd in ("plan", "advise"):
        args = build_parser().parse_args([cmd, "--model", "gpt2", "--gpu", "H100-80GB", "--gpus", "1"])
        assert args.reserve_fraction == 0.0
    args = build_parser().parse_args(["plan", "--model", "gpt2", "--gpu", "H100-80GB", "--gpus", "1",
                                      "--reserve-fraction", "0.1"])
    assert args.reserve_fraction == 0.1


@pytest.mark.slow
def test_screen_rejects_only_what_the_model_rejects():
    """The closed-form screen compares the allocated peak with the reserved budget (reserved ≥
    allocated): every configuration it drops closest to the budget has a reserved peak over it too."""
    model = load_model("gpt2")
    gpu = load_gpu("custom", memory_bytes=int(3.2 * GIB), bf16_flops=1e14)
    space = SearchSpace(attention=("flash", "eager"), recompute=("none", "full"), tp=(1,), cp=(1,), pp=(1,), zero=(0,),
                        offload=((),), sp=(False,), max_micro_batch=16)
    p = plan(model, seq=1024, global_batch=16, gpu=gpu, gpus=1, space=space, keep_rejected=True, front=False)
    dropped = [c for c, why in p.rejected if why.startswith("peak ")]
    assert dropped and any(c.fits for c in p.candidates)
    for cfg in dropped:
        step = StepSpec(batch=cfg["micro_batch"], seq=1024, grad_accum=cfg["grad_accum"])
        e = estimate(model, step, ImplSpec(attention=cfg["attention"], recompute=cfg["recompute"]))
        assert estimate_reserved(e).reserved_bytes >= e.peak_bytes > p.usable_bytes


@pytest.mark.slow
def test_sweep_verdict_is_estimates_at_the_boundary(capsys):
    """``sweep --gpu``: Mistral-7B S=4800 fits the flat budget, not the reserved one, as estimate says."""
    assert main(["sweep", "--model", "mistral-7b", "--over", "seq", "--precision", "bf16", "--attention", "mem-efficient",
                 "--start", "4800", "--max", "4864", "--gpu", "H100-80GB", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    at = next(p for p in data["points"] if p["value"] == 4800)
    v = _estimate_verdict(capsys, "mistral-7b", 4800, "mem-efficient", "none", "reserved")
    assert at["peak_bytes"] == v["allocated_bytes"] <= FLAT
    assert at["peak_reserved_bytes"] == v["reserved_bytes"] and at["fits"] is v["fits"] is False
    assert data["budget_bytes"] == v["capacity_bytes"] - v["context_bytes"]
