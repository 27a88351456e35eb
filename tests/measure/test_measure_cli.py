"""``trainmem profile`` / ``trainmem sweep`` from the command line: JSON contracts, one-line
errors with exit 2, and no half-written file after Ctrl-C or out-of-memory."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from trainmem.cli import main

from measure_tiny import LLAMA

ROOT = Path(__file__).resolve().parents[2]


def _cli(*args, timeout=120):
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    return subprocess.run([sys.executable, "-m", "trainmem.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env=env)


@pytest.fixture()
def tiny_config(tmp_path):
    path = tmp_path / "tiny.json"
    path.write_text(json.dumps(LLAMA))
    return str(path)


@pytest.mark.parametrize("args,needle", [
    (["sweep", "--over", "seq", "--budget", "80XB"], "budget='80XB'"),
    (["sweep", "--over", "foo", "--budget", "80GiB"], "--over"),
    (["sweep", "--over", "seq", "--budget", "80GiB", "--backend", "gpu"], "--backend"),
    (["profile", "--variants", "foo=1", "--run-on", "cpu"], "variants"),
    (["sweep", "--over", "seq", "--budget", "80GiB", "--model", "no-such-model"], "unknown model"),
])
def test_bad_input_is_one_line_exit_2(args, needle):
    r = _cli(*args)
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0]
    assert "Traceback" not in r.stderr and r.stdout == ""


def test_sweep_json_contract(capsys):
    assert main(["sweep", "--model", "llama-3-8b", "--over", "seq", "--budget", "80GiB", "--attention", "eager",
                 "--precision", "bf16", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["schema"] == "trainmem.sweep/2"
    assert {"max_fit", "points", "fit", "verdict", "crossover_seq"} <= set(d)
    assert {"value", "peak_bytes", "totals_bytes"} <= set(d["points"][0])
    assert d["fit"]["terms"]["attention_scores"]["exponent"] == pytest.approx(2.0, abs=0.01)
    assert d["verdict"] in ("linear", "quadratic") and d["crossover_seq"] > 0


def test_profile_json_contract_and_out_file(capsys, tiny_config, tmp_path):
    out = tmp_path / "res" / "profile.json"
    assert main(["profile", "--model", tiny_config, "--seq", "32", "--batch", "1", "--precision", "fp32",
                 "--run-on", "cpu", "--steps", "1", "--json", "--compare", "--out", str(out)]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["schema"] == "trainmem.profile/2" and d["device"] == "cpu"
    assert {"peak_bytes", "peak_reserved_bytes", "tokens_per_s", "ranks"} <= set(d)
    assert d["compare"]["rows"][-2]["name"] == "peak_allocated"
    # activations per tensor, keyed as the estimate's, joined three ways (tests/measure/test_measure_join.py)
    assert d["items"] == d["ranks"][0]["items"] and all("B:" in i["key"] for i in d["items"])
    assert set(d["compare"]["tensors"][0]) == {"key", "estimate", "trace", "measured", "equal"}
    # every estimate key has a measured partner of the same dtype and bytes, the loss value included
    # (loss.value, (root):4B:0: estimate/loss_value.py); the trace's only misses are the caller's ids
    est = [r for r in d["compare"]["tensors"] if r["estimate"]]
    assert all(r["measured"] and (r["measured"]["dtype"], r["measured"]["bytes"]) ==
               (r["estimate"]["dtype"], r["estimate"]["bytes"]) for r in est)
    assert [r["key"] for r in est if not r["trace"]] == ["(inputs):256B:0"]
    assert next(r for r in est if r["key"] == "(root):4B:0")["estimate"]["name"] == "loss.value"
    assert json.loads(out.read_text()) == d
    assert os.listdir(out.parent) == ["profile.json"]


def test_out_of_memory_leaves_no_file(monkeypatch, tiny_config, tmp_path, capsys):
    from trainmem.measure import profiling

    def oom(*a, **k):
        raise profiling.OutOfMemory("out of memory during a measured step (test); memory was released")

    monkeypatch.setattr(profiling, "profile_model", oom)
    out = tmp_path / "p.json"
    assert main(["profile", "--model", tiny_config, "--run-on", "cpu", "--out", str(out)]) == 2
    assert "OutOfMemory: out of memory" in capsys.readouterr().err
    assert not out.exists() and os.listdir(tmp_path) == ["tiny.json"]


@pytest.mark.slow  # 8-13 s: in the slow set so the default run stays under 10 minutes
def test_sweep_device_backend_continues_after_oom(monkeypatch):
    """OOM at a value is a point that does not fit; the search goes on below it."""
    from trainmem.measure import profiling, sweeps as sweep_mod
    from trainmem.specs import ImplSpec, StepSpec

    real = profiling.profile_model

    def capped(source, step, impl, **kw):
        if step.seq > 48:
            raise profiling.OutOfMemory("out of memory during a measured step (test); memory was released")
        return real(source, step, impl, **kw)

    monkeypatch.setattr(profiling, "profile_model", capped)
    r = sweep_mod.sweep(LLAMA, StepSpec(batch=1, precision="fp32"), ImplSpec(device="cpu"), over="seq",
                        budget_bytes=1 << 30, backend="device", start=32, stop=128, multiple=16, device="cpu")
    assert r.max_fit == 48
    oom = [p for p in r.points if p.peak_bytes is None]
    assert oom and all(not p.fits and "out of memory" in p.note for p in oom)


@pytest.mark.slow  # ~7 s on CI's two cores
def test_ctrl_c_stops_cleanly_without_partial_output(tmp_path, tiny_config):
    out = tmp_path / "p.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    proc = subprocess.Popen([sys.executable, "-m", "trainmem.cli", "profile", "--model", tiny_config, "--seq", "64",
                             "--run-on", "cpu", "--steps", "100000", "--out", str(out)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))  # as from a terminal
    time.sleep(6)  # imports, model built, inside the timed steps
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    # 130 from main(), whenever the signal lands: a Ctrl-C during torch's import used to end as -2
    # after main() had printed its line (cli._forget_unhandled_interrupt says why)
    assert proc.returncode == 130, err
    assert "Traceback" not in err and err.strip().splitlines()[-1] == "interrupted"
    assert not out.exists() and os.listdir(tmp_path) == ["tiny.json"]


@pytest.mark.slow  # 8-13 s: in the slow set so the default run stays under 10 minutes
def test_cpu_refuses_a_step_larger_than_the_host():
    r = _cli("profile", "--model", "llama-3-8b", "--seq", "4096", "--run-on", "cpu")
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.startswith("OutOfMemory: the estimated peak") and "--layers" in r.stderr


def test_public_api_and_flags_are_frozen():
    import argparse

    import trainmem.measure as tm
    from trainmem.measure.cli import add_parser

    assert sorted(tm.__all__) == sorted([
        "profile", "profile_model", "profile_workload", "ProfileResult", "RankProfile", "OutOfMemory",
        "build_workload", "sweep", "SweepResult", "SweepPoint", "compare_table", "compare_run", "CompareTable",
        "parse_variants", "run_variants", "VariantsResult", "parse_size", "fit_growth", "GrowthFit"])
    assert all(callable(getattr(tm, name)) for name in tm.__all__)
    sub = argparse.ArgumentParser().add_subparsers()
    add_parser(sub)
    flags = {name: sorted(o for a in p._actions for o in a.option_strings if o.startswith("--"))
             for name, p in sub.choices.items()}
    shared = ["--attention", "--batch", "--device", "--grad-accum", "--help", "--json", "--layers", "--loss",
              "--model", "--optimizer", "--out", "--precision", "--profile", "--recompute", "--recompute-every",
              "--recompute-from", "--run-on", "--seed", "--seq"] + ["--gpu", "--gpu-memory", "--memory-figure"]  # does it fit (fits.py)
    assert flags["profile"] == sorted(shared + ["--categories", "--compare", "--no-modules", "--snapshot",
                                                "--steps", "--top-modules", "--variants", "--warmup"])
    estimate_flags = ["--adapter-dtype", "--cp", "--cp-style", "--dp", "--ep", "--finetune", "--finetune-preset",
                      "--freeze", "--fsdp", "--fsdp-group", "--layer-split", "--lora-alpha", "--lora-dropout",
                      "--lora-rank", "--lora-targets", "--microbatches", "--no-reshard-after-forward", "--offload",
                      "--optimizer-impl", "--optimizer-in-backward", "--pp", "--routing", "--schedule", "--sp", "--tp",
                      "--virtual-stages", "--zero"]  # the estimate back-end's parallel and fine-tuning (b93b473)
    # public since: the QLoRA variants (c78fb78), Float8 (8ef72ba), FSDP1 (0782ea6)
    estimate_flags += ["--double-quant", "--no-double-quant", "--qlora-scope", "--quant-impl", "--quantize-head",
                       "--float8", "--float8-all-gather", "--fsdp-version"]
    estimate_flags += ["--no-loss-parallel"]  # TP loss_parallel (a3cb85a)
    estimate_flags += ["--fsdp-units"]  # FSDP units for the embedding and head (b16ffa8)
    assert flags["sweep"] == sorted(shared + estimate_flags + ["--backend", "--budget", "--html", "--max",
                                                               "--multiple", "--over", "--plot", "--start"])
