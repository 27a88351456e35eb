"""Every command's ``--json`` against its JSON Schema (draft 2020-12), and against a golden output.

The goldens (``golden/<command>.json``) keep the key structure (a key present there must stay;
new keys are additive and pass) and key values: bytes of the peak, of each ledger and phase, the
fitted values. Volatile fields (timings, versions, paths) are not kept. To rewrite them after a
change that is meant to move the numbers: ``TRAINMEM_UPDATE_GOLDEN=1 pytest tests/schema``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from schema_runs import argv, run_json, write_tiny
from trainmem.schemas import COMMANDS, LEDGERS, schema_name, schema_path
from trainmem.schemas.build import build_all, dumps

jsonschema = pytest.importorskip("jsonschema")

GOLDEN = Path(__file__).parent / "golden"
NEEDS_TORCH = {"trace", "compare", "profile", "snapshot", "variants"}  # real or fake torch steps: a few seconds each


def _values(command: str, d: dict) -> dict:
    """The values a golden keeps: exact integers and names, nothing measured in time."""
    if command == "estimate":
        return {"peak_bytes": d["peak_bytes"], "peak_phase": d["peak_phase"], "totals_bytes": d["totals_bytes"],
                "phases": [[p["name"], p["bytes"], p["parts"]] for p in d["phases"]], "num_items": len(d["items"])}
    if command == "trace":
        return {k: d[k] for k in ("peak_bytes", "peak_logical_bytes", "peak_reserved_bytes", "peak_phase",
                                  "totals_at_peak_bytes")} | {"num_items": len(d["items"])}
    if command == "compare":
        return {"peak": d["peak"], "activations": d["activations"]}
    if command == "profile":  # items: the measured activations, per tensor (exact on CPU)
        return {"device": d["device"], "num_ranks": len(d["ranks"]), "num_items": len(d["items"]),
                "items_bytes": sum(i["bytes"] for i in d["items"])}
    if command == "sweep":
        return {k: d[k] for k in ("over", "max_fit", "capped")} | {
            "points": [[p["value"], p["peak_bytes"]] for p in d["points"]]}
    if command == "plan":
        return {"num_candidates": len(d["candidates"]), "best": d["pareto"][0]["config"] if d["pareto"] else None}
    if command == "advise":
        return {k: d[k] for k in ("start_peak_bytes", "fits")} | {"steps": [s["rung"] for s in d["steps"]]}
    if command == "explain":
        return {"answers": [a["key"] for a in d["answers"]]}
    if command == "variants":
        return {"labels": [r["label"] for r in d["rows"]], "status": [r["status"] for r in d["rows"]]}
    return {k: d[k] for k in ("num_segments", "reserved_bytes", "peak_bytes")}  # snapshot


def _keys(v):
    """The key structure: dicts by key, a list by its first element, leaves as None."""
    if isinstance(v, dict):
        return {k: _keys(x) for k, x in v.items()}
    if isinstance(v, list):
        return [_keys(v[0])] if v and isinstance(v[0], (dict, list)) else []
    return None


def _missing(want, got, where="") -> list[str]:
    """Keys of ``want`` that ``got`` lacks (``got`` may have more)."""
    if isinstance(want, dict):
        if not isinstance(got, dict):
            return [where or "<root>"]
        return [m for k, w in want.items()
                for m in ([f"{where}.{k}"] if k not in got else _missing(w, got[k], f"{where}.{k}"))]
    if isinstance(want, list) and want:
        return _missing(want[0], got[0], f"{where}[0]") if isinstance(got, list) and got else [f"{where}[0]"]
    return []


def test_checked_in_schemas_are_what_build_writes():
    for command, schema in build_all().items():
        assert schema_path(command).read_text(encoding="utf-8") == dumps(schema), \
            f"{command}.json is stale: python -m trainmem.schemas.build"
        jsonschema.Draft202012Validator.check_schema(schema)
        assert schema["properties"]["schema"] == {"const": schema_name(command)}


def test_the_schemas_ship_as_package_data():
    import tomllib
    pyproject = tomllib.loads((Path(__file__).parents[2] / "pyproject.toml").read_text())
    assert "schemas/*.json" in pyproject["tool"]["setuptools"]["package-data"]["trainmem"]


def test_every_ledger_follows_the_schemas_rule():
    from trainmem.schemas.build import LEDGER
    rule = jsonschema.Draft202012Validator(LEDGER)
    assert all(rule.is_valid(c) for c in LEDGERS)
    assert not any(rule.is_valid(f"{c}s") for c in ("parameter", "gradient", "optimizer_state", "activation"))


def test_a_renamed_key_fails_validation():
    """The schemas are not vacuous: a /1 key name, a plural ledger, an unknown phase are refused."""
    validator = jsonschema.Draft202012Validator(json.loads(schema_path("estimate").read_text()))
    good = {"schema": "trainmem.estimate/2", "trainmem_version": "0", "profile": "hf",
            "inputs": {k: None for k in ("model", "step", "impl", "parallel", "finetune", "gpu")},
            "totals_bytes": {c: 0 for c in LEDGERS}, "peak_bytes": 1, "peak_phase": "forward",
            "phases": [{"name": "forward", "bytes": 1, "parts": {"activation": 1}}], "notes": []}
    assert not list(validator.iter_errors(good))
    for bad in ({**good, "schema": "trainmem.estimate/1"}, {**good, "totals_bytes": {"parameters": 1}},
                {**good, "peak_phase": "fwd"}, {k: v for k, v in good.items() if k != "inputs"},
                {**good, "inputs": {**good["inputs"], "model": {"name": "x", "source": "internet"}}}):
        assert list(validator.iter_errors(bad)), bad


@pytest.fixture(scope="module")
def outputs(tmp_path_factory):
    return {}


def _output(command, tmp_path_factory, capsys, outputs) -> dict:
    if command not in outputs:
        tmp = tmp_path_factory.getbasetemp() / "schema-runs"
        tmp.mkdir(exist_ok=True)
        model = write_tiny(tmp)
        if command == "snapshot":
            _output("trace", tmp_path_factory, capsys, outputs)  # writes the snapshot pickle
        outputs[command] = run_json(capsys, argv(command, model, tmp))
    return outputs[command]


@pytest.mark.parametrize("command", [pytest.param(c, marks=pytest.mark.slow) if c in NEEDS_TORCH else c
                                     for c in COMMANDS])
def test_json_validates_and_matches_the_golden(command, tmp_path_factory, capsys, outputs):
    d = _output(command, tmp_path_factory, capsys, outputs)
    schema = json.loads(schema_path(command).read_text())
    errors = [f"{'/'.join(map(str, e.absolute_path))}: {e.message[:200]}"
              for e in jsonschema.Draft202012Validator(schema).iter_errors(d)]
    assert not errors, errors
    assert list(d)[:3] == ["schema", "trainmem_version", "inputs"]  # the one header, first
    assert set(d["inputs"]) >= {"model", "step", "impl", "parallel", "finetune", "gpu"}
    if command != "snapshot":
        assert d["inputs"]["model"]["name"].endswith("config.json") and d["inputs"]["model"]["source"] == "file"
    path = GOLDEN / f"{command}.json"
    # the specs' own fields are the specs' business (tests/specs); the golden keeps which inputs there are
    keys = _keys({k: v for k, v in d.items() if k != "trainmem_version"})
    keys["inputs"] = dict.fromkeys(d["inputs"])
    got = {"keys": keys, "values": _values(command, d)}
    if os.environ.get("TRAINMEM_UPDATE_GOLDEN"):
        path.write_text(json.dumps(got, indent=1, sort_keys=True) + "\n")
    want = json.loads(path.read_text())
    assert not _missing(want["keys"], got["keys"]), f"keys gone from {command} --json"
    assert got["values"] == want["values"]


@pytest.mark.parametrize("extra", [
    ["--loss", "torchtune-chunked-ce"], ["--loss", "litgpt-chunked-ce"], ["--loss", "chunked-ce"],
    ["--loss", "fused-ce"], ["--recompute", "full", "--offload", "activations"], ["--optimizer-in-backward"],
    ["--recompute", "op"], ["--compile", "--compile-scope", "block"], ["--optimizer", "paged-adamw8bit"],
])
def test_estimate_variants_validate(extra, tmp_path, capsys):
    """Every phase and ledger an estimate variant names is in the schema's vocabulary (a phase added
    by a new mechanism, e.g. the chunked losses' ``head_backward``, must be added to PHASES)."""
    validator = jsonschema.Draft202012Validator(json.loads(schema_path("estimate").read_text()))
    data = run_json(capsys, ["estimate", "--model", write_tiny(tmp_path), "--seq", "64", "--device", "cpu",
                             "--precision", "bf16", *extra])
    assert not [e.message for e in validator.iter_errors(data)]
