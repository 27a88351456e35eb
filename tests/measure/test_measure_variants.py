"""Variants: the same batches under several settings; recompute does not change the numbers."""

import pytest

from trainmem.errors import SpecError
from trainmem.measure.variants import parse_variants, run_variants
from trainmem.specs import ImplSpec, StepSpec

from measure_tiny import LLAMA

STEP = StepSpec(batch=2, seq=128, precision="fp32")  # activations above the optimizer phase
IMPL = ImplSpec(attention="eager", device="cpu")


def test_parse_variants_is_the_product_of_the_axes():
    vs = parse_variants("attention=eager,sdpa;recompute=none,full", STEP, IMPL)
    assert [v.label for v in vs] == ["attention=eager recompute=none", "attention=eager recompute=full",
                                     "attention=sdpa recompute=none", "attention=sdpa recompute=full"]
    assert vs[3].impl.attention == "sdpa" and vs[3].impl.recompute == "full"
    b = parse_variants("batch=4x1,2x2;precision=fp32,bf16", STEP, IMPL)
    assert [(v.step.batch, v.step.grad_accum, v.step.precision) for v in b] == [
        (4, 1, "fp32"), (4, 1, "bf16"), (2, 2, "fp32"), (2, 2, "bf16")]


@pytest.mark.parametrize("bad", ["foo=1", "attention=", "attention=eager;attention=sdpa", "batch=4y2",
                                 "attention=nope", "", "precision=fp8"])
def test_parse_variants_rejects(bad):
    with pytest.raises(SpecError):
        parse_variants(bad, STEP, IMPL)


@pytest.mark.slow  # ~8 s on CI's two cores: three real training steps
def test_recompute_and_accumulation_keep_the_numerics():
    pytest.importorskip("transformers")
    vs = parse_variants("recompute=none,full", STEP, IMPL) + parse_variants("batch=1x2", STEP, IMPL)
    r = run_variants(LLAMA, vs, device="cpu", steps=1)
    rows = {row.label: row for row in r.rows}
    base = rows["recompute=none"]
    same = rows["recompute=full"]
    assert same.status == "ok"
    assert abs(same.loss_diff) < 1e-6 and same.grad_norm_rel_diff < 1e-5
    accum = rows["batch=1x2"]
    assert abs(accum.loss_diff) < 1e-5 and accum.grad_norm_rel_diff < 1e-4
    # recompute lowers the peak; accumulation halves the micro-batch activations
    assert same.peak_bytes < base.peak_bytes
    assert accum.peak_bytes < base.peak_bytes
    assert all(row.peak_reserved_bytes is None and row.tokens_per_s > 0 for row in r.rows)
    assert r.to_dict()["rows"][0]["loss_diff"] == 0.0
