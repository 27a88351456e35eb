"""Each command's ``--json`` on a tiny Llama (hidden 64, 2 layers, S=32), run in process."""

from __future__ import annotations

import json

from trainmem.cli import main

TINY_LLAMA = dict(model_type="llama", hidden_size=64, intermediate_size=176, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=4, vocab_size=1000, max_position_embeddings=256)


def write_tiny(folder) -> str:
    path = folder / "config.json"
    path.write_text(json.dumps(TINY_LLAMA))
    return str(path)


def argv(command: str, model: str, tmp) -> list[str]:
    """The command line whose ``--json`` the schema tests read (``tmp``: a folder for files)."""
    small = ["--model", model, "--seq", "32"]
    return {
        "estimate": ["estimate", *small],
        "trace": ["trace", *small, "--progress", "never", "--snapshot", str(tmp / "s.pickle")],
        "compare": ["compare", *small],
        "profile": ["profile", *small, "--precision", "fp32", "--run-on", "cpu", "--steps", "1"],
        "sweep": ["sweep", *small, "--over", "batch", "--budget", "64MiB"],
        "plan": ["plan", *small, "--gpu", "h100-80gb", "--gpus", "2", "--global-batch", "4"],
        "advise": ["advise", *small, "--gpu", "h100-80gb"],
        "explain": ["explain", *small],
        "snapshot": ["snapshot", str(tmp / "s.pickle")],
        "variants": ["profile", *small, "--precision", "fp32", "--run-on", "cpu", "--steps", "1",
                     "--variants", "attention=eager,sdpa"],
    }[command]


def run_json(capsys, args: list[str]) -> dict:
    capsys.readouterr()
    assert main([*args, "--json"]) == 0
    return json.loads(capsys.readouterr().out)
