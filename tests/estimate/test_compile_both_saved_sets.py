"""estimate --compile prints both saved sets, as trace does (issue 13, mechanism 1: "report both"):
the eager one is the same estimate without --compile, the compiled one the estimate's own."""

from __future__ import annotations

import json

import pytest

from trainmem.cli import main
from trainmem.estimate import estimate
from trainmem.report.units import fmt_bytes
from trainmem.specs import ImplSpec, StepSpec
from trainmem.specs.loaders import load_model

CFG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 128, "intermediate_size": 256,
       "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 1024,
       "max_position_embeddings": 512, "rms_norm_eps": 1e-5, "tie_word_embeddings": False}


@pytest.mark.parametrize("scope", ["model", "block"])
def test_text_names_eager_and_compiled_bytes(tmp_path, capsys, scope):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(CFG))
    assert main(["estimate", "--model", str(path), "--seq", "64", "--compile", "--compile-scope", scope]) == 0
    out = capsys.readouterr().out
    model, step = load_model(str(path)), StepSpec(batch=1, seq=64)
    eager = estimate(model, step, ImplSpec()).totals_bytes["activation"]
    compiled = estimate(model, step, ImplSpec(compile=True, compile_scope=scope)).totals_bytes["activation"]
    assert compiled < eager
    assert f"saved for backward: eager {fmt_bytes(eager)}, compiled {fmt_bytes(compiled)}" in out
    assert main(["estimate", "--model", str(path), "--seq", "64"]) == 0
    assert "saved for backward: eager" not in capsys.readouterr().out
