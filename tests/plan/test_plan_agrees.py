"""One number per configuration (issue 15, item 5): the plan table, the Pareto front, the JSON, the
HTML and ``estimate`` report the same per-rank peak; ``--gpus auto`` answers "how many GPUs";
the default global batch is shown; flash + selective recompute (a no-op) is not offered."""

from __future__ import annotations

import json
import re

import pytest

from trainmem.cli import main
from trainmem.estimate import estimate
from trainmem.plan.count import default_global_batch, gpu_counts
from trainmem.plan.hardware import load_gpu
from trainmem.plan.search import plan
from trainmem.specs import ImplSpec, ParallelSpec, StepSpec
from trainmem.specs.loaders import load_model


def _estimate_peak(model, cfg: dict, seq: int, precision: str) -> int:
    step = StepSpec(batch=cfg["micro_batch"], seq=seq, grad_accum=cfg["grad_accum"], precision=precision)
    impl = ImplSpec(attention=cfg["attention"], recompute=cfg["recompute"])
    par = ParallelSpec(dp=cfg["dp"], tp=cfg["tp"], sp=cfg["sp"], cp=cfg["cp"], pp=cfg["pp"],
                       microbatches=cfg["grad_accum"], zero=cfg["zero"], offload=tuple(cfg["offload"]))
    return estimate(model, step, impl, parallel=None if par.is_single else par).peak_bytes


@pytest.mark.parametrize("name, seq, batch, gpu, gpus", [
    ("llama-3-8b", 2048, 32, "l4", 16),      # TP, CP, PP, ZeRO and offload all appear
    ("mixtral-8x7b", 1024, 16, "h100-80gb", 16),  # MoE
    ("gpt2", 512, 8, "rtx-4090", 1),
])
def test_table_front_and_estimate_report_one_peak(name, seq, batch, gpu, gpus):
    model = load_model(name)
    p = plan(model, seq=seq, global_batch=batch, gpu=load_gpu(gpu), gpus=gpus, precision="mixed-bf16", top=8)
    assert p.candidates and p.pareto
    table = {json.dumps(c.config, sort_keys=True): c.peak_bytes for c in p.candidates}
    front = {json.dumps(c.config, sort_keys=True): c.peak_bytes for c in p.pareto}
    for key, peak in {**table, **front}.items():
        assert peak == _estimate_peak(model, json.loads(key), seq, "mixed-bf16")
    for key in table.keys() & front.keys():
        assert table[key] == front[key]
    # the fastest fitting configuration is on the front (nothing fits faster)
    assert json.dumps(p.candidates[0].config, sort_keys=True) in front
    data = p.to_dict()
    assert [c["peak_bytes"] for c in data["pareto"]] == [c.peak_bytes for c in p.pareto]
    assert all(c["peak_source"] == "estimator" for c in data["candidates"] + data["pareto"])


def test_flash_selective_is_not_offered():
    # selective recompute only drops flash's log-sum-exp (estimate/notes.py): not a distinct choice
    p = plan(load_model("llama-3-8b"), seq=2048, global_batch=32, gpu=load_gpu("l4"), gpus=16, precision="mixed-bf16")
    for c in (*p.candidates, *p.pareto):
        assert not (c.config["recompute"] == "selective" and c.config["attention"] in ("flash", "mem-efficient"))
    skipped = {k["attention"] for k in p.stats["skipped_kernels"]}
    assert skipped == {"flash", "mem-efficient"}
    assert ["eager", "selective"] in p.stats["kernel_sets"]  # eager keeps S×S scores: selective matters


def test_default_global_batch():
    # the smallest power of two of sequences with ≥ 2^20 tokens: 2^20 / 8192 = 128, 2^20 / 4096 = 256
    assert default_global_batch(8192)[0] == 128 and default_global_batch(4096)[0] == 256
    assert default_global_batch(3000)[0] == 512  # 256 × 3000 = 768,000 < 2^20 ≤ 512 × 3000
    assert default_global_batch(1 << 21)[0] == 1


def test_gpu_counts_are_powers_of_two_in_whole_nodes():
    h100 = load_gpu("h100-80gb")
    assert gpu_counts(h100, max_gpus=64) == [1, 2, 4, 8, 16, 32, 64]
    assert gpu_counts(h100, min_gpus=3, max_gpus=40) == [4, 8, 16, 32]
    four = load_gpu("h100-80gb", gpus_per_node=4)
    assert gpu_counts(four, min_gpus=2, max_gpus=16) == [2, 4, 8, 16]


@pytest.mark.slow  # ~5 s on CI's two cores
def test_gpus_auto_end_to_end(capsys, tmp_path):
    args = ["plan", "--model", "llama-3-8b", "--seq", "2048", "--gpu", "l4", "--gpus", "auto",
            "--precision", "mixed-bf16", "--max-gpus", "16"]
    html = tmp_path / "plan.html"
    assert main([*args, "--html", str(html)]) == 0
    text = capsys.readouterr().out
    # default global batch: 2^20 / 2048 = 512 sequences, stated
    one_line = " ".join(text.split())  # the title wraps at 120 columns
    assert "global batch 512 sequences (1,048,576 tokens/step; default: the smallest power of two" in one_line
    m = re.search(r"Smallest GPU count that fits: (\d+) × L4 \(tried (.*)\)", text)
    assert m, text
    n = int(m.group(1))
    assert f"hardware: {n} × L4" in text and "next count" in text
    assert main([*args, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    counts = data["gpu_counts"]
    assert [c["gpus"] for c in counts] == [c for c in (1, 2, 4, 8, 16) if c <= 2 * n]
    assert [c["fits"] for c in counts] == [c["gpus"] >= n for c in counts]
    assert data["inputs"]["gpus"] == n and all(c["fits"] for c in data["candidates"])
    # at half the count nothing fits, by the same planner run directly
    model = load_model("llama-3-8b")
    half = plan(model, seq=2048, global_batch=512, gpu=load_gpu("l4"), gpus=n // 2, precision="mixed-bf16")
    assert not any(c.fits for c in half.candidates)
    # the HTML report counts what the text counts, in the same words
    page = html.read_text()
    st = data["search"]
    for label, value in (("configurations screened", st["evaluated"]), ("fit by the closed-form screen", st["fitting"]),
                         ("checked with the per-rank estimate", st["checked"]), ("smallest GPU count that fits", n)):
        assert f'<div class="v">{value:,}</div><div class="l">{label}</div>' in page, label
    assert f"screened {st['evaluated']:,} configurations, {st['fitting']:,} fit by the closed-form screen" in text


def test_gpus_auto_bad_bounds_are_one_line(capsys):
    assert main(["plan", "--model", "gpt2", "--gpu", "l4", "--gpus", "auto", "--min-gpus", "16",
                 "--max-gpus", "8"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "max_gpus" in err[0] and "8" in err[0]
