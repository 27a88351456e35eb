"""``estimate`` and ``trace`` with ``--pp 2 --recompute every-k``: each pipeline rank counts its own blocks
(torchtitan's per-process ``_layer_sac_count``), placed by ``rank_classes`` and ``trace_step`` themselves. Tiny
Llama L=6, k=2 (blocks 1 and 4), fp32 B2 S64, 4 micro-batches: estimate == trace on every rank."""

from __future__ import annotations

import json

import pytest

from trainmem.cli import main

LAYERS = 6


@pytest.mark.slow  # two fake-tensor pipeline traces each, ~3 s apiece
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_cli_estimate_equals_trace_per_rank(capsys, tmp_path, schedule):
    cfg = tmp_path / "c.json"
    cfg.write_text(json.dumps(dict(model_type="llama", hidden_size=64, intermediate_size=176, num_hidden_layers=LAYERS,
                                   num_attention_heads=4, num_key_value_heads=2, vocab_size=256,
                                   max_position_embeddings=256, tie_word_embeddings=False)))
    flags = ["--model", str(cfg), "--batch", "2", "--seq", "64", "--precision", "fp32", "--optimizer", "adamw",
             "--device", "cpu", "--attention", "sdpa", "--pp", "2", "--microbatches", "4", "--schedule", schedule,
             "--recompute", "every-k", "--recompute-every", "2", "--json"]
    assert main(["estimate", *flags]) == 0
    e = {r["name"]: r["peak_bytes"] for r in json.loads(capsys.readouterr().out)["ranks"]}
    for rank in (0, 1):
        assert main(["trace", *flags, "--pp-rank", str(rank)]) == 0
        t = json.loads(capsys.readouterr().out)["peak_logical_bytes"]
        assert e[f"pp_stage_{rank}"] == t
    # first under pp: transformers' whole-model count (blocks 0, 2, 4), estimated per rank
    assert main(["estimate", *flags, "--recompute-from", "first"]) == 0
    assert len(json.loads(capsys.readouterr().out)["ranks"]) == 2
