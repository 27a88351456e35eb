"""Malformed, truncated and hostile input files: trainmem TOML, DeepSpeed JSON, torchtitan TOML,
Hugging Face config.json. Always one line and exit 2; never remote code (issue 8)."""

from __future__ import annotations

import json

import pytest

from hostile_helpers import TINY, assert_one_line_error

DEEP_JSON = "[" * 100_000 + "]" * 100_000
DEEP_TOML = "a = " + "[" * 100_000 + "]" * 100_000
BINARY = bytes(range(256)) * 4
HUGE = b"# " + b"x" * (2 << 20) + b"\n"

TOML_BODIES = {
    "empty": b"",
    "binary": BINARY,
    "utf16": "[step]\nbatch = 2\n".encode("utf-16"),
    "truncated": b"[step]\nbatch = ",
    "unclosed_table": b"[step\nbatch = 2\n",
    "deep": DEEP_TOML.encode(),
    "huge": HUGE,
    "nul": b"[step]\nbatch = 2\x00\n",
    "wrong_type": b"[step]\nbatch = \"two\"\n",
    "bool_for_int": b"[step]\nbatch = true\n",
    "float_for_int": b"[step]\nbatch = 2.5\n",
    "negative": b"[step]\nbatch = -4\n",
    "zero": b"[step]\nseq = 0\n",
    "huge_int": b"[step]\nseq = 9223372036854775807\n",
    "unknown_key": b"[step]\nbatchh = 2\n",
    "unknown_table": b"[stepp]\nbatch = 2\n",
    "table_is_scalar": b"step = 3\n",
    "array_for_str": b"[step]\nprecision = [\"bf16\"]\n",
    "bad_choice": b"[step]\nprecision = \"fp8-magic\"\n",
    "non_divisible": b"[parallel]\ntp = 3\n",
    "inf": b"[model]\nattn_dropout = inf\n",
    "nan": b"[model]\nattn_dropout = nan\n",
    "dup_key": b"[step]\nbatch = 2\nbatch = 3\n",
}
JSON_BODIES = {
    "empty": b"",
    "binary": BINARY,
    "truncated": b'{"zero_optimization": {"stage": ',
    "deep": DEEP_JSON.encode(),
    "huge": b'{"x": "' + b"x" * (2 << 20) + b'"}',
    "list": b"[1, 2, 3]",
    "string": b'"hello"',
    "null": b"null",
    "nan": b'{"train_micro_batch_size_per_gpu": NaN}',
    "infinity": b'{"train_micro_batch_size_per_gpu": Infinity}',
    "stage_string": b'{"zero_optimization": {"stage": "3"}}',
    "stage_9": b'{"zero_optimization": {"stage": 9}}',
    "stage_bool": b'{"zero_optimization": {"stage": true}}',
    "batch_negative": b'{"train_micro_batch_size_per_gpu": -1}',
    "batch_huge": b'{"train_micro_batch_size_per_gpu": 1e400}',
    "batch_float": b'{"train_micro_batch_size_per_gpu": 2.5}',
    "zero_is_list": b'{"zero_optimization": [3]}',
    "offload_garbage": b'{"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "floppy"}}}',
    "bf16_string": b'{"bf16": {"enabled": "yes"}}',
    "both_precisions": b'{"bf16": {"enabled": true}, "fp16": {"enabled": true}}',
    "lone_surrogate": b'{"x": "\\ud800"}',
}


def _write(tmp_path, name, body: bytes):
    path = tmp_path / name
    path.write_bytes(body)
    return str(path)


#: TOML bodies trainmem's own config accepts (the rest cannot be right)
CONFIG_OK = {"empty"}


@pytest.mark.parametrize("flag", ["--config", "--torchtitan"])
@pytest.mark.parametrize("case", sorted(TOML_BODIES))
def test_hostile_toml(cli, tmp_path, flag, case):
    """No --model or --seq on the command line: they would win over the file's [model] and [step]."""
    r = cli(["estimate", flag, _write(tmp_path, "c.toml", TOML_BODIES[case])])
    if r.rc != 0 or (flag == "--config" and case not in CONFIG_OK):
        assert_one_line_error(r)


@pytest.mark.parametrize("case", sorted(JSON_BODIES))
def test_hostile_deepspeed_json(cli, tiny, tmp_path, case):
    r = cli(["estimate", "--model", tiny, "--seq", "64", "--deepspeed", _write(tmp_path, "ds.json", JSON_BODIES[case])])
    if r.rc != 0 or case not in ("lone_surrogate", "both_precisions"):
        assert_one_line_error(r)


HF_BAD = {
    "not_json": b"model_type: llama",
    "list": b"[]",
    "no_model_type": json.dumps({k: v for k, v in TINY.items() if k != "model_type"}).encode(),
    "model_type_int": json.dumps({**TINY, "model_type": 5}).encode(),
    "unknown_type": json.dumps({**TINY, "model_type": "evil"}).encode(),
    "auto_map_unknown_type": json.dumps({**TINY, "model_type": "evil", "auto_map": {
        "AutoConfig": "evil.EvilConfig", "AutoModelForCausalLM": "evil.EvilModel"}}).encode(),
    "layers_string": json.dumps({**TINY, "num_hidden_layers": "2"}).encode(),
    "layers_float": json.dumps({**TINY, "num_hidden_layers": 2.5}).encode(),
    "layers_bool": json.dumps({**TINY, "num_hidden_layers": True}).encode(),
    "layers_null": json.dumps({**TINY, "num_hidden_layers": None}).encode(),
    "layers_zero": json.dumps({**TINY, "num_hidden_layers": 0}).encode(),
    "layers_negative": json.dumps({**TINY, "num_hidden_layers": -2}).encode(),
    "hidden_1e400": json.dumps({**TINY}).replace('"hidden_size": 32', '"hidden_size": 1' + "0" * 400).encode(),
    "heads_not_dividing": json.dumps({**TINY, "num_attention_heads": 5}).encode(),
    "kv_not_dividing": json.dumps({**TINY, "num_key_value_heads": 3}).encode(),
    "binary": BINARY,
    "deep": DEEP_JSON.encode(),
}


@pytest.mark.parametrize("command", ["estimate", "trace"])
@pytest.mark.parametrize("case", sorted(HF_BAD))
def test_hostile_hf_config(cli, tmp_path, command, case):
    r = cli([command, "--model", _write(tmp_path, "config.json", HF_BAD[case]), "--seq", "32"], timeout=60)
    assert r.rc == 2, r.err
    assert "Traceback" not in r.err and "internal error" not in r.err
    # transformers may log a warning line of its own before ours; ours is the last, and one line
    assert r.lines and ": " in r.lines[-1] and r.lines[-1].split(":")[0].endswith("Error")


def test_transformers_config_errors_are_one_line(cli, tmp_path):
    """The estimator ignores rope_scaling; building the model for a trace checks it."""
    body = json.dumps({**TINY, "rope_scaling": {"type": "bogus"}}).encode()
    r = cli(["trace", "--model", _write(tmp_path, "config.json", body), "--seq", "32"])
    assert r.rc == 2 and r.lines[-1].startswith("ConfigError: llama config rejected by transformers"), r.err


def test_auto_map_is_refused_and_never_imported(cli, tmp_path, monkeypatch):
    """A config whose only way to load is remote code: refused, and no module of it is imported."""
    import builtins

    imported = []
    real_import = builtins.__import__

    def spy(name, *a, **kw):
        if name.startswith("evil"):
            imported.append(name)
        return real_import(name, *a, **kw)

    monkeypatch.setattr(builtins, "__import__", spy)
    (tmp_path / "evil.py").write_text("raise SystemExit('remote code ran')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    path = _write(tmp_path, "config.json", HF_BAD["auto_map_unknown_type"])
    for command in (["estimate"], ["trace", "--seq", "32"]):
        r = cli([command[0], "--model", path, *command[1:]])
        assert_one_line_error(r)
        assert "never runs remote code" in r.err
    assert imported == []


@pytest.mark.parametrize("special", ["/dev/zero", "/dev/null", "/dev/urandom", "/proc/self/mem", "fifo"])
@pytest.mark.parametrize("flag", ["--config", "--deepspeed", "--torchtitan", "--model"])
def test_special_files_neither_hang_nor_exhaust_memory(cli, tiny, tmp_path, flag, special):
    import os

    if special == "fifo":
        special = str(tmp_path / "fifo")
        os.mkfifo(special)
    model = [] if flag == "--model" else ["--model", tiny]
    assert_one_line_error(cli(["estimate", *model, flag, special], timeout=10))


@pytest.mark.parametrize("args", [
    "--num-layers", '"unbalanced', "--hidden-size abc", "--num-layers -3", "--micro-batch-size 0",
    "--tensor-model-parallel-size 3", "--num-layers=2=3", "--seq-length 1" + "0" * 40, "--bf16 --fp16",
])
def test_hostile_megatron_args(cli, tiny, args):
    r = cli(["estimate", "--model", tiny, "--seq", "64", "--megatron-args", args])
    if r.rc != 0:
        assert_one_line_error(r)
