"""A checkpointed first block's output leaves backward_first_block's working set only where the blocks' node
moments are modelled (estimate/backward_moments.py ``_output_released``, block_backward.py
``node_moments_modelled``): with Gemma's 1 + w norm, OLMo-2's cast-last norm or routed experts the working set is
the bound and keeps the output. Tiny configs (h64, 2 layers, V512), AdamW for-loop, cpu, fp32, B2 S64, full recompute.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from trainmem.estimate import estimate
from trainmem.estimate.block_backward import node_moments_modelled
from trainmem.specs import ImplSpec, StepSpec
from trainmem.specs.loaders import spec_from_hf_config

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "trace"))
from tiny_families import DENSE  # noqa: E402

STEP = StepSpec(batch=2, seq=64, precision="fp32")
FULL, NONE = ImplSpec(device="cpu", optimizer_impl="for-loop", recompute="full"), \
    ImplSpec(device="cpu", optimizer_impl="for-loop")


def _first_block(cfg: dict) -> dict:
    e = estimate(spec_from_hf_config(cfg), STEP, FULL)
    return next(p for p in e.phases if p.name == "backward_first_block").parts


@pytest.mark.parametrize("cfg,modelled", [
    (dict(DENSE, model_type="llama"), True),
    (dict(DENSE, model_type="gemma", head_dim=16), False),  # 1 + w norm
    (dict(DENSE, model_type="olmo2"), False),  # cast-last norm
    (dict(DENSE, model_type="mixtral", num_local_experts=4, num_experts_per_tok=2), False),  # routed experts
])
def test_output_kept_where_node_moments_are_not_modelled(cfg, modelled):
    inv = estimate(spec_from_hf_config(cfg), STEP, NONE).inventory  # the recomputed blocks' tensors
    assert node_moments_modelled(inv) is modelled
    if not modelled:  # the gate: the release takes nothing off the working set (it stays the bound)
        assert _first_block(cfg)["activations"] == _without_release(cfg)


def _without_release(cfg: dict) -> int:
    """backward_first_block's activations part with the release switched off (our own function, not torch's)."""
    from trainmem.estimate import backward_moments

    real = backward_moments._output_released
    backward_moments._output_released = lambda *a: 0
    try:
        return _first_block(cfg)["activations"]
    finally:
        backward_moments._output_released = real
