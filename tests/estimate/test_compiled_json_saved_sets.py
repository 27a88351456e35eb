"""estimate --compile --json carries both saved sets under ``compile`` (the keys of trace's
``meta.compile``), as the text prints them: the eager one is the same estimate without --compile."""

from __future__ import annotations

import json

import pytest

from trainmem.cli import main
from trainmem.estimate import estimate
from trainmem.schemas import schema_path
from trainmem.specs import ImplSpec, StepSpec
from trainmem.specs.loaders import load_model

from test_compile_both_saved_sets import CFG  # noqa: E402  the tiny GQA Llama of the text test


@pytest.mark.parametrize("scope", ["model", "block-loss"])
def test_json_names_eager_and_compiled_bytes(tmp_path, capsys, scope):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(CFG))
    argv = ["estimate", "--model", str(path), "--seq", "64", "--precision", "bf16", "--json"]
    assert main([*argv, "--compile", "--compile-scope", scope]) == 0
    out = json.loads(capsys.readouterr().out)
    model, step = load_model(str(path)), StepSpec(batch=1, seq=64, precision="bf16")
    eager = estimate(model, step, ImplSpec()).totals_bytes["activation"]
    compiled = estimate(model, step, ImplSpec(compile=True, compile_scope=scope)).totals_bytes["activation"]
    assert out["compile"] == {"scope": scope, "saved_eager_bytes": eager, "saved_compiled_bytes": compiled}
    assert out["compile"]["saved_compiled_bytes"] == out["totals_bytes"]["activation"]
    jsonschema = pytest.importorskip("jsonschema")
    jsonschema.validate(out, json.loads(schema_path("estimate").read_text()))
    assert main(argv) == 0
    plain = json.loads(capsys.readouterr().out)
    assert "compile" not in plain and plain["totals_bytes"]["activation"] == eager
