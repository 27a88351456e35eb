"""The explainer's mixed-precision answer names the optimizer states' dtype only where the estimate
keeps every state in it: bitsandbytes keeps fp32 or uint8 states under any recipe, torchao uint8
codes (and the parameter's dtype below its quantization threshold), torch's the recipe's."""

from __future__ import annotations

import pytest

from trainmem.estimate import estimate
from trainmem.inventory import Category
from trainmem.plan.explain import mixed_precision
from trainmem.specs import StepSpec
from trainmem.specs.loaders import load_model
from trainmem.specs.step import OPTIMIZERS

MODEL = load_model("gpt2")
STATES = (Category.OPTIMIZER_STATE, Category.PAGED_STATE)


@pytest.mark.parametrize("opt", OPTIMIZERS)
def test_pure_bf16_states_named_as_estimated(opt):
    step = StepSpec(batch=1, seq=64, precision="bf16", optimizer=opt)
    e = estimate(MODEL, step)
    dtypes = {it.dtype for it in e.inventory.items if it.category in STATES}
    text = mixed_precision(MODEL, step, e).answer
    if not dtypes:  # sgd: no state to name
        return
    says_bf16 = "states are bfloat16" in text
    assert says_bf16 == (dtypes == {"bfloat16"}), (dtypes, text)
    assert ("as its library does" in text) == (dtypes != {"bfloat16"}), (dtypes, text)


def test_lion32bit_was_said_to_keep_bf16_states():
    # bitsandbytes' Lion32bit keeps fp32 state1 (Optimizer1State.init_state) under pure bf16
    step = StepSpec(batch=1, seq=64, precision="bf16", optimizer="lion32bit")
    e = estimate(MODEL, step)
    assert {it.dtype for it in e.inventory.items if it.category in STATES} == {"float32"}
    assert "bfloat16" not in mixed_precision(MODEL, step, e).answer
