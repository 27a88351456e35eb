"""A file's offload (a tuple) reaches ``--offload`` (a comma string when typed) through the CLI.

aed9d90 made ``--offload``'s default None; the input layer joined a file's tuple only over a str
default, so ``--hf-args`` ``fsdp: "full_shard offload"`` and a DeepSpeed offload stopped with an
internal error (exit 1) in ``cliargs.parallel_from_args``.
"""

from __future__ import annotations

import json

import pytest

from trainmem.cli import main

TINY = dict(model_type="llama", hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=128, max_position_embeddings=256)


@pytest.mark.parametrize("flag, body, typed", [
    ("--hf-args", {"fsdp": "full_shard offload"}, ["--fsdp", "full", "--offload", "optimizer,params", "--precision", "fp32"]),
    ("--deepspeed", {"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"},
                                           "offload_param": {"device": "cpu"}}},
     ["--zero", "3", "--offload", "optimizer,params", "--precision", "fp32"]),
])
def test_a_files_offload_equals_the_typed_flag(tmp_path, capsys, flag, body, typed):
    cfg, f = tmp_path / "config.json", tmp_path / "file.json"
    cfg.write_text(json.dumps(TINY))
    f.write_text(json.dumps(body))
    base = ["estimate", "--model", str(cfg), "--seq", "64", "--dp", "2", "--json"]
    assert main([*base, flag, str(f)]) == 0
    from_file = json.loads(capsys.readouterr().out)
    assert main([*base, *typed]) == 0
    from_flags = json.loads(capsys.readouterr().out)
    assert from_file["inputs"]["parallel"]["offload"] == ["optimizer", "params"]
    assert from_file["peak_bytes"] == from_flags["peak_bytes"]
