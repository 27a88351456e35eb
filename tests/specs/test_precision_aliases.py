"""Precision aliases (hf-bf16, torchtune-bf16), megatron-bf16, and the one-line description of what
every precision keeps, as the library, the CLI and the JSON show it."""

from __future__ import annotations

import json

import pytest

from trainmem.cli import main
from trainmem.errors import SpecError, UnsupportedError
from trainmem.estimate import estimate
from trainmem.specs import ModelSpec, StepSpec
from trainmem.specs.step import PRECISION_ALIASES, PRECISIONS, RECIPES, describe_precision

TINY = ModelSpec(name="tiny", hidden_size=64, num_layers=2, num_heads=4, ffn_size=128, vocab_size=100)
TINY_CONFIG = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
               "num_attention_heads": 4, "num_key_value_heads": 4, "vocab_size": 100}


@pytest.mark.parametrize("name", PRECISIONS)
def test_every_precision_says_what_it_keeps(name):
    d = describe_precision(name)
    assert d.startswith(f"{name}")
    for word in ("weights" if name != "fsdp-bf16" else "shards", "grads", "master", "optimizer states",
                 "activations"):
        assert word in d, (name, d)
    assert len("precision: " + d) <= 120 and "\n" not in d
    assert StepSpec(precision=name).precision_description == d


def test_alias_names_its_recipe():
    assert describe_precision("hf-bf16") == ("hf-bf16 = amp-bf16: fp32 weights, fp32 grads, no master, "
                                             "fp32 optimizer states, bf16 activations (autocast)")
    assert describe_precision("torchtune-bf16").startswith("torchtune-bf16 = bf16: bf16 weights, bf16 grads")
    assert set(PRECISION_ALIASES.values()) <= set(RECIPES)


@pytest.mark.parametrize("alias,recipe", sorted(PRECISION_ALIASES.items()))
def test_alias_equals_its_recipe_exactly(alias, recipe):
    a, r = StepSpec(batch=2, seq=32, precision=alias), StepSpec(batch=2, seq=32, precision=recipe)
    assert a.precision == alias and a.recipe == recipe and a.dtypes == r.dtypes
    ea, er = estimate(TINY, a), estimate(TINY, r)
    assert ea.peak_bytes == er.peak_bytes and ea.totals_bytes == er.totals_bytes
    assert [(i.name, i.bytes) for i in ea.inventory] == [(i.name, i.bytes) for i in er.inventory]


def test_megatron_bf16_is_mixed_bf16_with_fp32_gradients():
    meg = estimate(TINY, StepSpec(batch=2, seq=32, precision="megatron-bf16")).totals_bytes
    mix = estimate(TINY, StepSpec(batch=2, seq=32, precision="mixed-bf16")).totals_bytes
    # N parameters in bf16 under both: 2·N bytes; Megatron's fp32 main gradients 4·N, mixed-bf16's 2·N
    n = mix["parameter"] // 2
    assert meg["parameter"] == mix["parameter"] == 2 * n
    assert meg["gradient"] == 4 * n and mix["gradient"] == 2 * n
    assert {k: v for k, v in meg.items() if k != "gradient"} == {k: v for k, v in mix.items() if k != "gradient"}


def test_trace_refuses_megatron_bf16_in_one_line():
    from trainmem.trace import trace_step
    with pytest.raises(UnsupportedError, match="megatron-bf16.*mixed-bf16") as err:
        trace_step(TINY_CONFIG, StepSpec(batch=1, seq=16, precision="megatron-bf16"))
    assert "\n" not in str(err.value)


def test_unknown_precision_lists_recipes_and_aliases():
    with pytest.raises(SpecError, match="precision='bf17'") as err:
        StepSpec(precision="bf17")
    assert "megatron-bf16" in str(err.value) and "hf-bf16" in str(err.value) and "torchtune-bf16" in str(err.value)


def test_cli_text_and_json_show_the_typed_alias_and_its_description(capsys):
    args = ["estimate", "--model", "gpt2", "--seq", "128", "--precision", "hf-bf16"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "precision=hf-bf16" in out and f"precision: {describe_precision('hf-bf16')}" in out
    assert main([*args, "--json"]) == 0
    step = json.loads(capsys.readouterr().out)["inputs"]["step"]
    assert step["precision"] == "hf-bf16" and step["precision_recipe"] == "amp-bf16"
    assert step["precision_description"] == describe_precision("hf-bf16")


@pytest.mark.slow  # ~4-6 s (a trace)
def test_trace_text_shows_the_description(capsys):
    from trainmem.trace import trace_step
    from trainmem.report.trace_text import render_trace
    r = trace_step(TINY_CONFIG, StepSpec(batch=1, seq=16, precision="torchtune-bf16"))
    assert f"precision: {describe_precision('torchtune-bf16')}" in render_trace(r)
    b = trace_step(TINY_CONFIG, StepSpec(batch=1, seq=16, precision="bf16"))
    assert r.peak_bytes == b.peak_bytes


@pytest.mark.parametrize("argv,precision", [
    (["compare", "--model", "CONFIG", "--seq", "64"], "hf-bf16"),  # the trace runs autocast on CPU
    (["explain", "--model", "gpt2", "--seq", "128"], "megatron-bf16"),
    (["sweep", "--model", "gpt2", "--over", "batch", "--budget", "4GiB", "--max", "2"], "megatron-bf16"),
    (["advise", "--model", "gpt2", "--seq", "128", "--gpu", "l4", "--max-estimates", "2"], "megatron-bf16"),
    (["profile", "--model", "CONFIG", "--seq", "16", "--run-on", "cpu", "--steps", "1"], "hf-bf16"),
], ids=lambda a: a[0] if isinstance(a, list) else a)
def test_every_command_says_what_the_precision_keeps(argv, precision, capsys, tmp_path):
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(TINY_CONFIG))
    argv = [str(cfg) if a == "CONFIG" else a for a in argv]
    assert main([*argv, "--precision", precision]) == 0
    assert f"precision: {describe_precision(precision)}" in capsys.readouterr().out.splitlines()
