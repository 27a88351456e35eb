"""The trace on fake tensors equals the same step on real CPU tensors, to the byte (issue 14's check).

Small dims (hidden 256, 2 layers, B=2, S=256), eager and SDPA attention, fp32 and bf16, one family
of each kind: a dense decoder, a MoE decoder (routing fixed by ``ImplSpec.routing``), an encoder
and an encoder-decoder. Marked slow (about a minute per family on two CPU cores).
"""

import pytest

from tiny_families import FAMILIES
from trainmem.specs import ImplSpec, StepSpec
from trainmem.trace import trace_step

WIDE = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2)
CONFIGS = {
    "olmo2": dict(FAMILIES["olmo2"], **WIDE),
    "qwen3_moe": dict(FAMILIES["qwen3_moe"], **WIDE, head_dim=64, moe_intermediate_size=128),
    "roberta": dict(FAMILIES["roberta"], hidden_size=256, intermediate_size=512),
    "t5": dict(FAMILIES["t5"], d_model=256, d_ff=512, d_kv=64),
}


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("attention", ["eager", "sdpa"])
@pytest.mark.parametrize("family", sorted(CONFIGS))
def test_trace_peak_equals_real_step_peak(family, attention, precision):
    step = StepSpec(batch=2, seq=256, precision=precision)
    impl = ImplSpec(attention=attention, device="cpu")
    fake = trace_step(CONFIGS[family], step, impl)
    real = trace_step(CONFIGS[family], step, impl, real=True)
    assert fake.meta["fake"] and not real.meta["fake"]
    assert fake.peak_bytes == real.peak_bytes
    assert fake.totals_at_peak_bytes == real.totals_at_peak_bytes
