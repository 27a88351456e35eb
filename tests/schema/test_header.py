"""The one header every --json starts with, and the vocabulary's helpers."""

from __future__ import annotations

import json

import pytest

from trainmem.schemas import (COMMANDS, figure_key, header, model_input, model_source, part_key, schema_name,
                              set_inputs)
from trainmem.specs import ImplSpec, StepSpec
from trainmem.specs.loaders import load_model


def test_header_resolves_every_input_or_says_null():
    h = header("estimate", model=load_model("gpt2"), step=StepSpec(seq=64), impl=ImplSpec())
    assert list(h) == ["schema", "trainmem_version", "inputs"] and h["schema"] == "trainmem.estimate/2"
    assert list(h["inputs"]) == ["model", "step", "impl", "parallel", "finetune", "gpu"]
    m = h["inputs"]["model"]
    assert (m["name"], m["source"], m["family"], m["hidden_size"]) == ("gpt2", "preset", "gpt2", 768)
    assert h["inputs"]["step"]["seq"] == 64 and h["inputs"]["parallel"] is None and h["inputs"]["gpu"] is None
    json.dumps(h)  # plain JSON


def test_model_sources(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    assert model_source("llama-3-8b") == "preset"
    assert model_source(str(tmp_path)) == "folder"
    assert model_source(str(tmp_path / "config.json")) == "file"
    assert model_source("acme/tiny") == "hf_cache"
    assert model_source("MyModule") == "code"


def test_model_input_maps_a_config_and_keeps_an_unknown_type_by_name():
    cfg = dict(model_type="llama", hidden_size=64, intermediate_size=176, num_hidden_layers=2,
               num_attention_heads=4, vocab_size=1000)
    assert model_input(cfg, "tiny.json").hidden_size == 64 and model_input(cfg, "tiny.json").name == "tiny.json"
    assert model_input({"model_type": "nobody"}, "MyModule") == "MyModule"
    out = set_inputs(header("trace"), model="MyModule")
    assert out["inputs"]["model"] == {"name": "MyModule", "source": "code"}


def test_set_inputs_refuses_an_unknown_input():
    with pytest.raises(ValueError, match="input='gpus'"):
        set_inputs(header("plan"), gpus=8)


def test_vocabulary_helpers():
    assert [part_key(k) for k in ("parameters", "optimizer_states", "activations", "logits", "work")] == \
        ["parameter", "optimizer_state", "activation", "logits", "work"]
    assert [figure_key(f) for f in ("allocated", "reserved", "active")] == \
        ["peak_bytes", "peak_reserved_bytes", "peak_active_bytes"]
    assert {schema_name(c) for c in COMMANDS} == {f"trainmem.{c}/2" for c in COMMANDS}
    with pytest.raises(ValueError):
        schema_name("serve")
    with pytest.raises(ValueError):
        figure_key("free")
