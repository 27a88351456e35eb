"""`trainmem estimate --mode inference` end to end: the serving question answered in one command."""

from __future__ import annotations

import contextlib
import io
import json
import os
from types import SimpleNamespace

import pytest

from trainmem.cli import main


def run(*argv: str) -> SimpleNamespace:
    """``python -m trainmem.cli ARGV`` in this process (cli.py's ``__main__`` is ``main()``): the exit
    code and both streams, with TRAINMEM_DEBUG unset. A fresh interpreter per case cost ~1 s each;
    tests/hostile/test_isolation.py runs the CLI as a subprocess."""
    out, err = io.StringIO(), io.StringIO()
    debug = os.environ.pop("TRAINMEM_DEBUG", None)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                rc = main(list(argv))
            except SystemExit as exc:  # argparse's own exits
                rc = exc.code
    finally:
        if debug is not None:
            os.environ["TRAINMEM_DEBUG"] = debug
    return SimpleNamespace(returncode=rc, stdout=out.getvalue(), stderr=err.getvalue())


def test_serving_command_answers_concurrency_per_rank():
    r = run("estimate", "--model", "llama-3-8b", "--mode", "inference", "--seq", "2048", "--context", "8192",
            "--precision", "bf16", "--weights", "fp8", "--kv-dtype", "fp8", "--tp", "2", "--prefill-chunk", "512",
            "--gpu", "h100-80gb")
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert "serving: weights=fp8 kv_cache=float8 context=8192 block=16 sequences=1 prompt=2048 prefill_chunk=512" in out
    assert "layout: tp=2 pp=1" in out
    assert "fits " in out and "concurrent sequences of 8,192 tokens on 2× H100-80GB" in out
    for training_word in ("optimizer", "loss", "gradient", "grad_accum"):
        assert training_word not in out


def test_serving_json_carries_the_settings_and_capacity():
    r = run("estimate", "--model", "llama-3-8b", "--mode", "inference", "--seq", "1024", "--precision", "bf16",
            "--pp", "2", "--gpu", "h100-80gb", "--gpu-memory-utilization", "0.8", "--json")
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    assert d["serving"]["gpu_memory_utilization"] == 0.8 and d["serving"]["context"] == 1024
    assert [x["name"] for x in d["ranks"]] == ["stage 0", "stage 1"]
    c = d["capacity"]
    assert c["sequences"] == c["blocks"] // (1024 // 16) and c["gpus"] == 2


@pytest.mark.parametrize("argv,field", [
    (["--kv-dtype", "fp8"], "kv_dtype"),                                        # training mode
    (["--mode", "inference", "--weight-group", "64"], "weight_group"),          # without int4
    (["--mode", "inference", "--gpu-memory-utilization", "0.9"], "gpu_memory_utilization"),  # without --gpu
    (["--mode", "inference", "--gpu", "h100-80gb", "--gpu-memory-utilization", "1.5"], "gpu_memory_utilization"),
    (["--mode", "inference", "--tp", "3"], "tp"),
    (["--mode", "inference", "--zero", "3"], "zero"),
    (["--mode", "inference", "--weights", "int4", "--weight-group", "100"], "weight_group"),
    (["--mode", "inference", "--weights", "int3"], "--weights"),
])
def test_bad_serving_input_is_one_line(argv, field):
    r = run("estimate", "--model", "llama-3-8b", "--seq", "1024", *argv)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert field in r.stderr and r.stdout == ""


@pytest.mark.parametrize("view", [[], ["--summary"], ["--tree", "2"], ["--detail"]])
def test_every_inference_view_shows_serving_settings_only(view):
    r = run("estimate", "--model", "llama-3-8b", "--mode", "inference", "--seq", "512", "--precision", "bf16",
            "--weights", "int4", "--pp", "2", *view)
    assert r.returncode == 0, r.stderr
    assert "serving: weights=int4 G=128 kv_cache=bfloat16 context=512" in r.stdout
    for training_word in ("adamw", "optimizer", "gradient", "master_weight", "loss"):
        assert training_word not in r.stdout
