"""The command line as a user runs it: output, JSON contract, bad input."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from trainmem.cli import main


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "trainmem.cli", *args], capture_output=True, text=True, timeout=120)


def test_estimate_without_arguments_prints_a_full_report(capsys):
    assert main(["estimate"]) == 0
    out = capsys.readouterr().out
    for needle in ("llama-3-8b", "Ledgers", "parameter", "optimizer_state", "activation",
                   "block 0", "B·S·F·2", "Phases", "Peak:", "profile=hf"):
        assert needle in out, needle


def test_json_contract(capsys):
    assert main(["estimate", "--model", "gpt2", "--batch", "2", "--seq", "512", "--precision", "amp-bf16",
                 "--attention", "eager", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["schema"] == "trainmem.estimate/2"
    assert set(data["totals_bytes"]) >= {"parameter", "gradient", "master_weight", "optimizer_state", "activation"}
    assert data["inputs"]["model"]["family"] == "gpt2" and data["inputs"]["step"]["batch"] == 2
    assert data["peak_phase"] in {p["name"] for p in data["phases"]}
    assert all(isinstance(v, int) for v in data["totals_bytes"].values())
    item = data["items"][0]
    assert set(item) >= {"name", "category", "shape", "dtype", "bytes", "formula"}
    acts = [i for i in data["items"] if i["category"] == "activation"]
    assert sum(i["bytes"] for i in acts) == data["totals_bytes"]["activation"]
    assert any(i["name"] == "transformer.h.0.attn.softmax" for i in acts)


@pytest.mark.parametrize("args,needle", [
    (["estimate", "--batch", "0"], "--batch=0"),
    (["estimate", "--seq", "-5"], "--seq=-5"),
    (["estimate", "--seq", "abc"], "--seq='abc'"),
    (["estimate", "--model", "llama-2-7"], "llama-2-7b"),
    (["estimate", "--precision", "fp8"], "fp8"),
    (["estimate", "--seq", "1000000000000", "--batch", "1000"], "seq=1000000000000"),
    (["estimate", "--model", "/nonexistent/config.json"], "/nonexistent/config.json"),
    (["estimate", "--recompute", "full", "--recompute-every", "2"], "recompute_every=2"),
])
def test_bad_input_is_one_line_and_exit_2(args, needle):
    proc = run(*args)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert needle in lines[0]
    assert proc.stdout == ""


def test_malformed_config_file(tmp_path):
    bad = tmp_path / "config.json"
    bad.write_text('{"model_type": "llama", "hidden_size": ')
    proc = run("estimate", "--model", str(bad))
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1
    assert "config.json" in proc.stderr


def test_hf_config_file_estimates(tmp_path):
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(dict(model_type="qwen2", hidden_size=256, intermediate_size=512,
                                   num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2,
                                   vocab_size=1000)))
    proc = run("estimate", "--model", str(tmp_path), "--json")
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["inputs"]["model"]["num_kv_heads"] == 2


def test_commands_and_estimate_flags_are_frozen():
    """Changing the command line is a decision: this test makes it a visible one."""
    from trainmem.cli import build_parser

    sub = next(a for a in build_parser()._actions if a.__class__.__name__ == "_SubParsersAction")
    assert sorted(sub.choices) == ["advise", "compare", "estimate", "explain", "plan", "presets", "profile",
                                   "serve", "snapshot", "sweep", "trace"]
    flags = sorted(o for a in sub.choices["estimate"]._actions for o in a.option_strings if o.startswith("--"))
    assert flags == [
        "--adapter-dtype", "--attention", "--batch", "--block-size", "--compile", "--compile-scope", "--config", "--context", "--cp",
        "--cp-style",
        "--deepspeed", "--detail", "--device", "--double-quant", "--dp", "--ep", "--finetune", "--finetune-preset", "--float8",
        "--float8-all-gather", "--framework", "--freeze",
        "--fsdp", "--fsdp-group", "--fsdp-units", "--fsdp-version", "--gpu", "--gpu-memory", "--gpu-memory-utilization", "--grad-accum", "--head", "--help",
        "--hf-args", "--html", "--json",
        "--kv-dtype", "--layer-split",
        "--lora-alpha", "--lora-dropout", "--lora-rank", "--lora-targets", "--loss", "--megatron-args",
        "--memory-figure", "--microbatches", "--mode",
        "--model", "--no-double-quant", "--no-loss-parallel", "--no-reshard-after-forward", "--num-labels", "--offload", "--optimizer", "--optimizer-impl",
        "--optimizer-in-backward", "--plot", "--pp", "--precision", "--prefill-chunk",
        "--profile", "--qlora-scope", "--quant-impl", "--quantize-head", "--recompute", "--recompute-every",
        "--recompute-from", "--routing", "--schedule", "--seq", "--sp", "--summary",
        "--torchtitan", "--torchtune", "--tp", "--tree", "--virtual-stages", "--weight-group", "--weights", "--zero"]


def test_public_estimator_api():
    import trainmem.estimate as est
    import trainmem.inventory as inv
    import trainmem.specs as specs

    assert est.__all__ == ["estimate", "Estimate"]
    assert sorted(specs.__all__) == ["ImplSpec", "ModelSpec", "ParallelSpec", "StepSpec"]
    assert sorted(inv.__all__) == ["Category", "DTYPE_BYTES", "Inventory", "LEDGERS", "MemoryItem", "Repeat",
                                   "dtype_bytes"]
