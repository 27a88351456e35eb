"""Hand-written hf rules for gpt-oss (``estimate/rules_gpt_oss.py``) and Llama-4 text
(``estimate/rules_llama4.py``): the estimate's activations equal autograd's saved set to the byte on
tiny configs (CPU), and equal ``--profile traced``."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

torch = pytest.importorskip("torch")

from trainmem.errors import UnsupportedError  # noqa: E402
from trainmem.estimate import estimate  # noqa: E402
from trainmem.specs import ImplSpec, StepSpec  # noqa: E402
from trainmem.specs.loaders import load_model, spec_from_hf_config  # noqa: E402

from kinds_configs import CONFIGS, check_against_autograd  # noqa: E402

# (family, precision, attention, recompute); gpt-oss has no SDPA path in transformers. Each builds and
# runs a real model (~1-3 s once torch is warm, 20 s cold): slow, since the default suite is at its
# 10-minute budget; test_*_block_items pin the per-block items and these measured totals by default
ALL = [("gpt_oss", p, "eager", r) for p in ("fp32", "bf16", "amp-bf16") for r in ("none", "full")]
ALL += [("llama4_text", p, a, "none") for p in ("fp32", "bf16", "amp-bf16") for a in ("sdpa", "eager")]
ALL += [("llama4_text", p, "sdpa", "full") for p in ("fp32", "bf16")]
CASES = [pytest.param(*c, marks=pytest.mark.slow) for c in ALL]


@pytest.mark.parametrize("name,precision,attention,recompute", CASES)
def test_activations_equal_autograd(name, precision, attention, recompute):
    check_against_autograd(CONFIGS[name], precision, attention, recompute)


def test_gpt_oss_block_items():
    """B=2, S=64, H=64, A=4, Akv=2, hd=16, E=4, k=2, Fe=32, bf16, eager (kinds_configs.CONFIGS)."""
    from trainmem.estimate.activations import activation_items

    items = activation_items(spec_from_hf_config(CONFIGS["gpt_oss"]), StepSpec(batch=2, seq=64, precision="bf16"),
                             ImplSpec(attention="eager", device="cpu"))
    got = {i.name.removeprefix("model.layers.1."): i.bytes for i in items if i.name.startswith("model.layers.1.")}
    assert got["self_attn.softmax"] == 2 * 4 * 64 * 65 * 2  # B·A·S·(S+1)·2 = 66,560: the sink column
    assert got["self_attn.max_idx"] == 2 * 4 * 64 * 8  # B·A·S·8 = 4,096: amax's int64 indices
    assert got["input_layernorm.normed"] == 2 * 64 * 64 * 4  # fp32, multiplied by w before the cast
    assert got["mlp.router.scores"] == 2 * 64 * 2 * 2  # softmax over the k top values, B·S·k·2
    assert got["mlp.experts.gate_up"] == 2 * 64 * 2 * 64 * 2  # B·S·k·2Fe·2: both clamps keep views of it
    # sigmoid, clamped gate, up + 1, glu, (up + 1)·glu: five B·S·k·Fe tensors of 2·64·2·32·2 = 16,384
    assert sum(v for n, v in got.items() if n.split(".")[-1] in
               ("sigmoid", "gate_clamped", "up_plus_one", "glu", "gated")) == 5 * 16384
    # what autograd's saved-tensor hooks measured on the real model (test_activations_equal_autograd)
    assert sum(i.bytes for i in items) == 1_327_652 + 4  # and the fp32 loss the caller holds (loss.value)


def test_gpt_oss_refuses_sdpa_in_one_line():
    # GptOssPreTrainedModel._supports_sdpa is False: transformers refuses to build it with SDPA
    model = spec_from_hf_config(CONFIGS["gpt_oss"])
    with pytest.raises(UnsupportedError, match="no sdpa attention.*--attention eager.*--profile traced"):
        estimate(model, StepSpec(batch=2, seq=64), ImplSpec(device="cpu", attention="sdpa"))


def test_llama4_block_items():
    """B=2, S=64, H=64, A=4, Akv=2, hd=16, E=4, k=1, Fe=32, chunks of 16, bf16, SDPA (kinds_configs.CONFIGS):
    blocks chunked/dense, chunked/MoE, chunked/dense, full NoPE/MoE."""
    from trainmem.estimate.activations import activation_items

    items = activation_items(spec_from_hf_config(CONFIGS["llama4_text"]), StepSpec(batch=2, seq=64, precision="bf16"),
                             ImplSpec(attention="sdpa", device="cpu"))
    got = {i.name: i.bytes for i in items}
    assert got["model.rotary_emb.freqs_cis"] == 64 * 8 * 8  # S·hd/2 complex64 = 4,096, kept once
    at1, at3 = "model.layers.1.self_attn.", "model.layers.3.self_attn."
    assert got[at1 + "q_norm.x_fp32"] == 2 * 64 * 4 * 16 * 4  # the L2 norm's fp32 input, B·S·A·hd·4
    assert got[at1 + "attn_mask"] == 2 * 64 * 64 * 2  # S >= chunk: SDPA's additive mask, B·S·S·2
    assert at3 + "attn_mask" not in got and at3 + "q_norm.x_fp32" not in got  # NoPE: causal, no qk norm
    assert got[at3 + "attn_scales"] == 64 * 4  # temperature tuning's (1, S, 1, 1) fp32 scales
    ff = "model.layers.3.feed_forward."
    assert got[ff + "router.sigmoid"] == 2 * 64 * 4 * 4  # fp32 (B·S, E)
    assert got[ff + "experts.gate_up"] == 4 * 128 * 64 * 2  # every token through every expert: E·B·S·2Fe·2
    # what autograd's saved-tensor hooks measured on the real model (test_activations_equal_autograd)
    assert sum(i.bytes for i in items) == 2_176_772 + 4  # and the fp32 loss the caller holds (loss.value)


#: hf rules == --profile traced (the same model on fake tensors, its checkpointing included): totals and peak
TRACED = [(n, a, p, "none") for n, a in (("gpt_oss", "eager"), ("llama4_text", "sdpa"), ("llama4_text", "eager"))
          for p in ("fp32", "bf16")]
TRACED += [("gpt_oss", "eager", "bf16", "selective"), ("gpt_oss", "eager", "fp32", "selective"),
           ("llama4_text", "eager", "bf16", "selective"), ("llama4_text", "sdpa", "fp32", "selective"),
           ("llama4_text", "eager", "bf16", "full"), ("llama4_text", "sdpa", "bf16", "op"),
           ("llama4_text", "eager", "bf16", "op"), ("gpt_oss", "eager", "bf16", "op")]


@pytest.mark.slow
@pytest.mark.parametrize("name,attention,precision,recompute", TRACED)
def test_hf_rules_equal_the_traced_profile(tmp_path, monkeypatch, name, attention, precision, recompute):
    monkeypatch.setenv("TRAINMEM_CACHE", str(tmp_path / "cache"))
    path = tmp_path / "config.json"
    path.write_text(json.dumps(CONFIGS[name]))
    model, step = load_model(str(path)), StepSpec(batch=2, seq=64, precision=precision)
    impl = ImplSpec(profile="traced", device="cpu", attention=attention, recompute=recompute)
    traced = estimate(model, step, impl)
    ruled = estimate(model, step, replace(impl, profile="hf"))
    assert traced.totals_bytes == ruled.totals_bytes
    assert traced.peak_bytes == ruled.peak_bytes
