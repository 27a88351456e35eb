"""``--attention`` defaults to the model family's kernel (``Family.attentions``, first): transformers
builds gpt-oss (sinks) and Gemma-2 (soft-capping) without SDPA (``_supports_sdpa = False``), so
their presets run eager when no kernel is asked for; an explicit ``--attention sdpa`` on gpt-oss is
still refused in one line. Every command that takes ``--attention`` resolves it the same way and
echoes the resolved kernel in its header's inputs."""

from __future__ import annotations

import json

import pytest

from trainmem.cli import main
from trainmem.estimate import estimate
from trainmem.families import default_attention, family_attentions, families
from trainmem.specs.loaders import list_presets, load_config_dict, load_model
from trainmem.specs.presets import estimated_presets

GPT_OSS = [p for p in list_presets() if load_config_dict(p)["model_type"] == "gpt_oss"]


def _json(capsys, *argv: str) -> dict:
    assert main([*argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_families_without_sdpa_default_to_eager():
    assert {f.name for f in families() if f.attentions[0] != "sdpa"} == {"gpt_oss", "gemma2"}
    assert default_attention("gpt_oss") == "eager" and family_attentions("gpt_oss") == ("eager",)
    assert default_attention("llama") == "sdpa" and default_attention("no-such-family") == "sdpa"
    assert GPT_OSS == ["gpt-oss-120b", "gpt-oss-20b"]
    assert set(GPT_OSS) | {"gemma-2-9b"} <= set(estimated_presets())


@pytest.mark.parametrize("preset", GPT_OSS + ["gemma-2-9b", "llama-3-8b"])
def test_estimate_at_defaults_echoes_the_family_attention(preset, capsys):
    out = _json(capsys, "estimate", "--model", preset)
    family = load_model(preset).family
    assert out["inputs"]["impl"]["attention"] == default_attention(family)
    # the library's default (impl=None) is the same kernel and the same estimate
    assert out["peak_bytes"] == estimate(load_model(preset)).peak_bytes
    assert main(["estimate", "--model", preset]) == 0
    header = capsys.readouterr().out.splitlines()[2]
    assert f"attention={default_attention(family)} " in header, header


@pytest.mark.parametrize("preset", GPT_OSS)
def test_explicit_sdpa_on_gpt_oss_is_refused_in_one_line(preset, capsys):
    assert main(["estimate", "--model", preset, "--attention", "sdpa"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and err.startswith("UnsupportedError: ")
    assert "no sdpa attention" in err and "--attention eager" in err


def test_a_typed_or_filed_attention_wins_over_the_family_default(tmp_path, capsys):
    assert _json(capsys, "estimate", "--model", "gemma-2-9b", "--attention", "flash")["inputs"]["impl"][
        "attention"] == "flash"
    config = tmp_path / "run.toml"
    config.write_text('[impl]\nattention = "sdpa-math"\n')
    assert _json(capsys, "estimate", "--model", "llama-3-8b", "--seq", "256", "--config", str(config))[
        "inputs"]["impl"]["attention"] == "sdpa-math"


def test_plan_searches_only_the_kernels_a_family_runs(capsys):
    argv = ["plan", "--model", "gpt-oss-20b", "--gpu", "h100-80gb", "--gpus", "1", "--global-batch", "1",
            "--seq", "256"]
    out = _json(capsys, *argv)
    # the default space is flash, mem-efficient, eager: gpt-oss runs eager alone
    assert {kernel for kernel, _ in out["search"]["kernel_sets"]} == {"eager"}, out["search"]
    assert main([*argv, "--attention", "flash"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "attention" in err and "gpt_oss runs only eager" in err
