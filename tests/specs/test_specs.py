"""Spec validation: every error names the field and the value."""

from __future__ import annotations

import pytest

from trainmem.errors import SpecError
from trainmem.specs import ImplSpec, ModelSpec, StepSpec

BASE = dict(hidden_size=64, num_layers=2, num_heads=4, ffn_size=128, vocab_size=100)


@pytest.mark.parametrize("field,value,needle", [
    ("hidden_size", 0, "hidden_size=0"),
    ("num_layers", -3, "num_layers=-3"),
    ("num_heads", 5, "num_heads=5"),          # does not divide 64
    ("num_kv_heads", 3, "num_kv_heads=3"),    # does not divide 4 heads
    ("activation", "swish", "activation='swish'"),
    ("attn_dropout", 1.5, "attn_dropout=1.5"),
    ("vocab_size", "big", "vocab_size='big'"),
    ("top_k", 2, "num_experts=0"),
])
def test_model_spec_errors_name_field_and_value(field, value, needle):
    with pytest.raises(SpecError) as err:
        ModelSpec(**{**BASE, field: value})
    assert needle in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize("kwargs,needle", [
    (dict(batch=0), "batch=0"),
    (dict(seq=-1), "seq=-1"),
    (dict(seq=10**12, batch=10**3), "seq=1000000000000"),
    (dict(precision="fp8"), "precision='fp8'"),
    (dict(optimizer="lion"), "optimizer='lion'"),
])
def test_step_spec_errors(kwargs, needle):
    with pytest.raises(SpecError, match=needle.replace("(", r"\(")):
        StepSpec(**kwargs)


def test_impl_spec_errors_and_aliases():
    assert ImplSpec(attention="memory-efficient").attention == "mem-efficient"
    with pytest.raises(SpecError, match="recompute_every=2"):
        ImplSpec(recompute="full", recompute_every=2)
    with pytest.raises(SpecError, match="profile='deepspeed'"):
        ImplSpec(profile="deepspeed")


def test_defaults_fill_derived_fields():
    m = ModelSpec(**BASE)
    assert (m.num_kv_heads, m.head_dim) == (4, 16)
    moe = ModelSpec(**BASE, num_experts=8, top_k=2)
    assert moe.expert_ffn_size == 128
