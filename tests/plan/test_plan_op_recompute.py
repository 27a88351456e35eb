"""plan --recompute op: torchtitan's op-level checkpointing searched when named (issue 13, mechanism 2).
Every peak plan prints is the estimate's for that configuration (as tests/plan/test_plan_agrees.py
checks for the default modes); here for op."""

from __future__ import annotations

import json

from trainmem.cli import main
from trainmem.estimate import estimate
from trainmem.specs import ImplSpec, ParallelSpec, StepSpec
from trainmem.specs.loaders import load_model


def test_plan_searches_op_recompute_and_its_peak_is_the_estimates(capsys):
    assert main(["plan", "--model", "gpt2", "--seq", "512", "--global-batch", "8", "--gpu", "l4", "--gpus", "2",
                 "--recompute", "op", "--attention", "flash", "--top", "2", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["candidates"]
    for c in data["candidates"]:
        cfg = c["config"]
        assert cfg["recompute"] == "op"
        e = estimate(load_model("gpt2"), StepSpec(batch=cfg["micro_batch"], seq=512, grad_accum=cfg["grad_accum"]),
                     ImplSpec(attention=cfg["attention"], recompute="op"),
                     ParallelSpec(dp=cfg["dp"], tp=cfg["tp"], sp=cfg["sp"], cp=cfg["cp"], pp=cfg["pp"],
                                  zero=cfg["zero"], microbatches=cfg["grad_accum"], offload=tuple(cfg["offload"])))
        assert c["peak_bytes"] == e.peak_bytes
