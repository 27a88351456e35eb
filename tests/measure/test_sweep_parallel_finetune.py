"""``sweep`` and the ``estimate --plot`` sweep panel take the parallel and fine-tuning flags
(issue 15, item 4): every point is the estimator's per-rank peak for that layout and fine-tuning."""

from __future__ import annotations

import json
from dataclasses import replace

from trainmem.cli import main
from trainmem.estimate import estimate
from trainmem.estimate.scaling import scaling_sweeps
from trainmem.measure.sweeps import sweep
from trainmem.specs import ImplSpec, ParallelSpec, StepSpec
from trainmem.specs.finetune import FinetuneSpec
from trainmem.specs.loaders import load_model

GPT2 = load_model("gpt2")


def test_sweep_lora_on_a_24gb_card_answers(capsys):
    """The issue's command, as written."""
    assert main(["sweep", "--model", "qwen2.5-7b", "--over", "batch", "--budget", "24GiB", "--finetune", "lora",
                 "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["inputs"]["finetune"]["mode"] == "lora"
    model = load_model("qwen2.5-7b")
    step = StepSpec(**{k: d["inputs"]["step"][k] for k in ("batch", "seq", "grad_accum", "precision", "optimizer",
                                                         "loss")})
    lora = FinetuneSpec(mode="lora")
    for p in d["points"]:
        s = replace(step, batch=p["value"])
        assert p["peak_bytes"] == estimate(model, s, ImplSpec(), finetune=lora).peak_bytes
        assert p["peak_bytes"] < estimate(model, s, ImplSpec()).peak_bytes  # not the full-training peak


def test_sweep_lora_shorter_sequences_finds_a_batch(capsys):
    assert main(["sweep", "--model", "qwen2.5-7b", "--over", "batch", "--budget", "24GiB", "--finetune", "lora",
                 "--seq", "1024", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    best = d["max_fit"]
    assert best is not None and best >= 1
    model, lora = load_model("qwen2.5-7b"), FinetuneSpec(mode="lora")
    assert estimate(model, StepSpec(batch=best, seq=1024), ImplSpec(), finetune=lora).peak_bytes <= 24 << 30
    assert estimate(model, StepSpec(batch=best + 1, seq=1024), ImplSpec(), finetune=lora).peak_bytes > 24 << 30


def test_sweep_per_rank_with_parallel_degrees():
    par = ParallelSpec(dp=2, tp=2, sp=True, zero=1)
    step, impl = StepSpec(batch=1, seq=256), ImplSpec(attention="flash")
    r = sweep(GPT2, step, impl, over="seq", budget_bytes=1 << 30, start=256, stop=1024, parallel=par)
    assert r.meta["parallel"]["tp"] == 2
    for p in r.points:
        assert p.peak_bytes == estimate(GPT2, replace(step, seq=p.value), impl, par).peak_bytes
        assert p.peak_bytes < estimate(GPT2, replace(step, seq=p.value), impl).peak_bytes


def test_trace_backend_refuses_parallel_in_one_line(capsys):
    rc = main(["sweep", "--model", "gpt2", "--over", "seq", "--budget", "1GiB", "--backend", "trace", "--tp", "2"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and "backend" in err[0] and "estimate" in err[0]


def test_plot_panel_at_its_own_point_is_the_per_rank_peak():
    """A TP/PP estimate's sweep panel shows per-rank peaks: at the estimate's own seq and batch the
    panel's value is the estimate's peak (before: the unsharded single-device peak)."""
    par = ParallelSpec(tp=2, pp=2, microbatches=4)
    step = StepSpec(batch=2, seq=512)
    e = estimate(GPT2, step, ImplSpec(), par)
    panels = scaling_sweeps(e)
    for over, value in (("seq", 512), ("batch", 2)):
        point = next(p for p in panels[over]["points"] if p["value"] == value)
        assert point["peak_bytes"] == e.peak_bytes
    assert e.peak_bytes < estimate(GPT2, step, ImplSpec()).peak_bytes
    lora = FinetuneSpec(mode="lora", lora_targets=("c_attn",))
    ef = estimate(GPT2, step, ImplSpec(), finetune=lora)
    point = next(p for p in scaling_sweeps(ef)["seq"]["points"] if p["value"] == 512)
    assert point["peak_bytes"] == ef.peak_bytes
