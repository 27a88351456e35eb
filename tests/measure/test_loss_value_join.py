"""The loss value (``loss.value``, estimate/loss_value.py): the 0-dim loss the caller holds from the end
of the forward until backward is done is an estimate item, so estimate, trace and a measured step pair
on every estimate key (``trainmem profile --compare``).

Fast: the item on every loss path the estimate models (pure arithmetic, no torch step). Slow: the CLI's
three-way join on tiny Llama and GPT-2, fp32 and bf16 (a real CPU step and a fake trace each).
"""

from __future__ import annotations

import json

import pytest

from measure_tiny import GPT2, LLAMA


@pytest.mark.parametrize("loss,precision,profile,key,dtype", [
    # ForCausalLMLoss upcasts: nll_loss's fp32 output, made before its total weight (:1)
    ("ce", "fp32", "hf", "(root):4B:0", "float32"),
    ("ce", "bf16", "hf", "(root):4B:0", "float32"),
    ("ce", "fp32", "reference", "(root):4B:0", "float32"),
    # torchtune: total_loss / total_elements in fp32, after the 8 chunks' total weights
    ("torchtune-chunked-ce", "bf16", "hf", "(root):4B:8", "float32"),
    # LitGPT: cat(losses).sum() / count in the logits' dtype, after the chunk's total weight (same dtype)
    ("litgpt-chunked-ce", "bf16", "hf", "(root):2B:1", "bfloat16"),
    ("litgpt-chunked-ce", "fp32", "hf", "(root):4B:1", "float32"),
])
def test_the_loss_value_is_one_item_of_the_loss_dtype(loss, precision, profile, key, dtype):
    from trainmem.estimate import estimate
    from trainmem.specs import ImplSpec, StepSpec
    from trainmem.specs.loaders import spec_from_hf_config

    step = StepSpec(batch=1, seq=32, precision=precision, loss=loss)
    e = estimate(spec_from_hf_config(LLAMA, name="tiny"), step, ImplSpec(device="cpu", profile=profile))
    [item] = [i for i in e.inventory if i.name == "loss.value"]
    assert (item.key, item.dtype, item.shape, item.category.value) == (key, dtype, (), "activation")
    assert item.bytes == (2 if dtype == "bfloat16" else 4)
    # in the forward phase of the model's own loss (made at its end); a chunked loss's forward peak is
    # inside its last chunk, before the division that makes it
    fwd = next(p for p in e.phases if p.name == "forward").parts["activations"]
    assert fwd == e.totals_bytes["activation"] - (item.bytes if loss != "ce" else 0)


@pytest.mark.slow  # a real CPU step and a fake-tensor trace per case (5-15 s on 2 shared cores)
@pytest.mark.parametrize("family", ["llama", "gpt2"])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_profile_compare_pairs_every_estimate_key(family, precision, tmp_path, capsys):
    from trainmem.cli import main

    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({"llama": LLAMA, "gpt2": GPT2}[family]))
    assert main(["profile", "--model", str(cfg), "--seq", "32", "--batch", "1", "--precision", precision,
                 "--run-on", "cpu", "--steps", "1", "--no-modules", "--json", "--compare"]) == 0
    rows = json.loads(capsys.readouterr().out)["compare"]["tensors"]
    est = [r for r in rows if r["estimate"]]
    assert len(est) > 30
    side = lambda r, s: r[s] and (r[s]["dtype"], r[s]["bytes"])  # noqa: E731
    # every estimate key: a measured tensor of the same dtype and bytes
    assert [r["key"] for r in est if side(r, "measured") != side(r, "estimate")] == []
    # and a traced one, but the token ids (an input to the trace, not an op output)
    assert [r["key"] for r in est if side(r, "trace") != side(r, "estimate")] == ["(inputs):256B:0"]
    # the loss itself and nll_loss's total weight, in that order on all three sides
    loss, weight = (next(r for r in rows if r["key"] == k) for k in ("(root):4B:0", "(root):4B:1"))
    assert (loss["estimate"]["name"], weight["estimate"]["name"]) == ("loss.value", "loss.total_weight")
    # what only the trace holds: backward's seed (ones_like), made before the trace's forward ends
    assert [r["key"] for r in rows if not r["estimate"] and r["trace"]] == ["(root):4B:2"]
