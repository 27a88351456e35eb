"""Compile settings in input files -> --compile with the framework's scope (issue 13, mechanism 1),
or eager with one note line when the compiled rules refuse the model or setup.

Scopes, read from each framework's source: the HF Trainer's accelerate compiles the whole model
(Accelerator.prepare_model: torch.compile(model)); torchtitan compiles each TransformerBlock and,
with "loss" in [compile] components, the loss (parallelize.py apply_compile, components/loss.py);
torchtune compiles each layer and the loss (training/_compile.py compile_model, compile_loss)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from trainmem.cli import main
from trainmem.errors import ConfigError
from trainmem.inputs import read_hf_args, read_torchtitan, read_torchtune

DATA = Path(__file__).parent / "data" / "torchtune"
LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 128, "intermediate_size": 256,
         "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 1024,
         "max_position_embeddings": 512, "rms_norm_eps": 1e-5, "tie_word_embeddings": False}
NEOX = {"architectures": ["GPTNeoXForCausalLM"], "model_type": "gpt_neox", "hidden_size": 64, "intermediate_size": 256,
        "num_hidden_layers": 2, "num_attention_heads": 4, "vocab_size": 1000,
        "max_position_embeddings": 256}  # a family without compiled rules


def write(tmp_path, name: str, text: str) -> str:
    p = tmp_path / name
    p.write_text(text)
    return str(p)


def impl_of(answer: dict) -> dict:
    return answer["overrides"].get("impl", {})


@pytest.mark.parametrize("args, impl", [
    ({"torch_compile": True}, {"compile": True, "compile_scope": "model"}),
    # TrainingArguments.__post_init__: a mode (or a backend) turns torch_compile on
    ({"torch_compile_mode": "default"}, {"compile": True, "compile_scope": "model"}),
    ({"torch_compile": True, "torch_compile_backend": "inductor"}, {"compile": True, "compile_scope": "model"}),
    ({"torch_compile": True, "torch_compile_backend": "aot_eager"}, {}),  # not inductor's partition: eager
    ({"torch_compile": False}, {}),
])
def test_hf_args_compile_the_whole_model(tmp_path, args, impl):
    answer = read_hf_args(write(tmp_path, "args.json", json.dumps(args)))
    assert impl_of(answer) == impl
    if args.get("torch_compile_backend") == "aot_eager":
        assert any("estimated as eager, backend 'aot_eager'" in n for n in answer["notes"])


@pytest.mark.parametrize("table, impl", [
    ("enable = true", {"compile": True, "compile_scope": "block-loss"}),  # components default ["model", "loss"]
    ('enable = true\ncomponents = ["model"]', {"compile": True, "compile_scope": "block"}),
    ('enable = true\ncomponents = ["loss"]', {}),
    ('enable = true\nbackend = "aot_eager"', {}),
    ("enable = false", {}),
])
def test_torchtitan_compile_each_block_and_the_loss(tmp_path, table, impl):
    answer = read_torchtitan(write(tmp_path, "job.toml", f"[compile]\n{table}\n"))
    assert {k: v for k, v in impl_of(answer).items() if k.startswith("compile")} == impl
    if "true" in table and not impl:
        assert any(n.startswith("[compile] enable: estimated as eager") for n in answer["notes"])


def test_torchtitan_unknown_component_is_an_error(tmp_path):
    with pytest.raises(ConfigError, match="'optimizer' is not model or loss"):
        read_torchtitan(write(tmp_path, "job.toml", '[compile]\nenable = true\ncomponents = ["optimizer"]\n'))


@pytest.mark.parametrize("value, impl", [
    ("True", {"compile": True, "compile_scope": "block-loss"}),
    # full_finetune_distributed.py: a mapping, model and loss default true
    ("\n  loss: False", {"compile": True, "compile_scope": "block"}),
    ("\n  model: False", {}),
    ("False", {}),
])
def test_torchtune_compile_each_layer_and_the_loss(tmp_path, value, impl):
    text = (DATA / "llama3_1_8B_full_single_device.yaml").read_text().replace("compile: False", f"compile: {value}")
    answer = read_torchtune(write(tmp_path, "r.yaml", text))
    assert {k: v for k, v in impl_of(answer).items() if k.startswith("compile")} == impl


def test_torchtune_unknown_compile_key_is_an_error(tmp_path):
    text = (DATA / "llama3_1_8B_full_single_device.yaml").read_text().replace("compile: False", "compile:\n  modle: 1")
    with pytest.raises(ConfigError, match="unknown key 'modle'"):
        read_torchtune(write(tmp_path, "r.yaml", text))


def run_json(capsys, argv: list[str]) -> dict:
    capsys.readouterr()
    assert main([*argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_hf_args_compile_equals_the_flag(tmp_path, capsys):
    model = write(tmp_path, "config.json", json.dumps(LLAMA))
    args = write(tmp_path, "args.json", json.dumps({"torch_compile": True, "per_device_train_batch_size": 2}))
    from_file = run_json(capsys, ["estimate", "--model", model, "--seq", "64", "--hf-args", args])
    from_flags = run_json(capsys, ["estimate", "--model", model, "--seq", "64", "--batch", "2", "--precision", "fp32",
                                       "--compile"])
    assert from_file["inputs"]["impl"]["compile"] is True
    assert from_file["compile"] == from_flags["compile"]
    assert from_file["peak_bytes"] == from_flags["peak_bytes"]
    assert from_file["totals_bytes"] == from_flags["totals_bytes"]


def test_torchtune_compile_equals_the_flags(tmp_path, capsys):
    text = (DATA / "llama3_1_8B_full_single_device.yaml").read_text().replace("compile: False", "compile: True")
    from_file = run_json(capsys, ["estimate", "--torchtune", write(tmp_path, "r.yaml", text), "--seq", "512"])
    flags = ["estimate", "--model", "llama-3-8b", "--seq", "512", "--batch", "2", "--precision", "bf16",
             "--recompute", "full", "--optimizer", "paged-adamw8bit", "--optimizer-in-backward",
             "--compile", "--compile-scope", "block-loss"]
    from_flags = run_json(capsys, flags)
    assert from_file["compile"] == from_flags["compile"]
    assert from_file["compile"]["scope"] == "block-loss"
    assert from_file["peak_bytes"] == from_flags["peak_bytes"]


@pytest.mark.parametrize("config, args, why", [
    (NEOX, {"torch_compile": True}, "no compiled rules for gpt_neox"),
    # bf16=True over fp32 weights is autocast (amp-bf16), which whole-model compile rules refuse
    (LLAMA, {"torch_compile": True, "bf16": True}, "precision='hf-bf16' is not modelled"),
])
def test_refused_compile_from_a_file_is_eager_with_one_note(tmp_path, capsys, config, args, why):
    model = write(tmp_path, "config.json", json.dumps(config))
    path = write(tmp_path, "args.json", json.dumps(args))
    out = run_json(capsys, ["estimate", "--model", model, "--seq", "64", "--hf-args", path])
    eager = run_json(capsys, ["estimate", "--model", model, "--seq", "64", "--precision",
                              "amp-bf16" if args.get("bf16") else "fp32"])
    assert "compile" not in out and out["inputs"]["impl"]["compile"] is False
    assert out["peak_bytes"] == eager["peak_bytes"]
    line = (f"compile set in {path}: estimated as eager, {why}")
    notes = [n for n in out["inputs"]["files"]["hf-args"]["notes"] if "compile" in n]
    assert len(notes) == 1 and notes[0].startswith(line)
    assert notes[0].endswith("; trainmem trace --compile gives the compiled saved set")
    capsys.readouterr()
    assert main(["estimate", "--model", model, "--seq", "64", "--hf-args", path]) == 0
    assert f"- {line}" in " ".join(capsys.readouterr().out.split())  # the text wraps at 120 columns


def test_typed_compile_is_still_refused(tmp_path, capsys):
    model = write(tmp_path, "config.json", json.dumps(NEOX))
    path = write(tmp_path, "args.json", json.dumps({"torch_compile": True}))
    assert main(["estimate", "--model", model, "--seq", "64", "--hf-args", path, "--compile"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "compile: model='gpt_neox' is not modelled" in err
