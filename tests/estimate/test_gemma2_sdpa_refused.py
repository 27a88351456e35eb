"""An explicit SDPA kernel on Gemma-2 (attention logit soft-capping): transformers 5.x refuses to
build it (``Gemma2PreTrainedModel._supports_sdpa = False``; ``PreTrainedModel._sdpa_can_dispatch``
raises ValueError, with or without ``attn_logit_softcapping``; eager only when no kernel is asked
for), it neither falls back to eager nor runs SDPA without the soft-cap. The estimate refuses the
same kernels in one line (``rules_hf._refuse_sdpa``), as ``trainmem trace`` does, instead of
estimating an SDPA step that drops the soft-cap; eager (its default) is unchanged."""

from __future__ import annotations

import json

import pytest

from trainmem.cli import main
from trainmem.errors import UnsupportedError
from trainmem.estimate import estimate
from trainmem.specs import ImplSpec, StepSpec
from trainmem.specs.loaders import spec_from_hf_config

CFG = dict(model_type="gemma2", vocab_size=500, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
           num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=16)
SDPA = ("sdpa", "sdpa-math", "mem-efficient")  # every one is attn_implementation="sdpa" in transformers


@pytest.mark.parametrize("attention", SDPA)
def test_the_estimate_refuses_sdpa_in_one_line(attention):
    with pytest.raises(UnsupportedError) as exc:
        estimate(spec_from_hf_config(CFG), StepSpec(batch=2, seq=64), ImplSpec(device="cpu", attention=attention))
    msg = str(exc.value)
    assert "\n" not in msg and f"no {attention} attention" in msg and "--attention eager" in msg


@pytest.mark.parametrize("softcap", [50.0, None])
def test_transformers_refuses_it_too(softcap):
    pytest.importorskip("transformers")
    from trainmem.models.hf import build_hf_model

    # build_hf_model is what trainmem trace and --profile traced build: the real from_config
    with pytest.raises(UnsupportedError, match="gemma2 has no sdpa attention in transformers"):
        build_hf_model({**CFG, "attn_logit_softcapping": softcap}, attention="sdpa", init_weights=False)


def test_the_cli_refuses_estimate_and_trace_in_one_line(tmp_path, capsys):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(CFG))
    for command in ("estimate", "trace"):
        argv = [command, "--model", str(path), "--batch", "2", "--seq", "64", "--device", "cpu", "--attention", "sdpa"]
        assert main(argv) == 2, command
        out, err = capsys.readouterr()
        assert out == "" and err.count("\n") == 1 and err.startswith("UnsupportedError: "), (command, err)
        assert "no sdpa attention" in err and "--attention eager" in err


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["bf16", "fp32"])
def test_eager_estimate_equals_the_traced_profile(tmp_path, monkeypatch, precision):
    """The kernel transformers does build: hf rules == --profile traced, totals and peak, to the byte."""
    pytest.importorskip("torch")
    monkeypatch.setenv("TRAINMEM_CACHE", str(tmp_path / "cache"))
    model, step = spec_from_hf_config(CFG), StepSpec(batch=2, seq=64, precision=precision)
    ruled = estimate(model, step, ImplSpec(device="cpu", attention="eager"))
    path = tmp_path / "config.json"
    path.write_text(json.dumps(CFG))
    from trainmem.specs.loaders import load_model

    traced = estimate(load_model(str(path)), step, ImplSpec(profile="traced", device="cpu", attention="eager"))
    assert traced.totals_bytes == ruled.totals_bytes
    assert traced.peak_bytes == ruled.peak_bytes
