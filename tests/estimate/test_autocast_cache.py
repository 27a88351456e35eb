"""Autocast's weight-cast cache (estimate/autocast_cache.py): under ``--precision amp-bf16`` every trainable
weight's bf16 copy stays cached until the autocast region (forward + loss) ends, so a checkpointed block,
which saves none of them, still holds them through the forward; and the final norm's fp32 output, which the
head only reads through a cast, stays alive in the model output until the loss is made."""

from __future__ import annotations

import pytest

from trainmem.estimate import estimate
from trainmem.specs import ImplSpec, StepSpec
from trainmem.specs.loaders import spec_from_hf_config

#: tiny Llama: h512, F1024, 4 heads (2 KV heads of 128), 2 layers, V128
CFG = dict(model_type="llama", hidden_size=512, intermediate_size=1024, num_hidden_layers=2,
           num_attention_heads=4, num_key_value_heads=2, vocab_size=128)


def _forward(recompute: str, grad_accum: int = 2):
    step = StepSpec(batch=1, seq=64, precision="amp-bf16", optimizer="sgd", grad_accum=grad_accum)
    e = estimate(spec_from_hf_config(CFG), step, ImplSpec(device="cpu", recompute=recompute))
    return e, next(p for p in e.phases if p.name == "forward")


def test_checkpointed_blocks_still_hold_their_cached_weight_casts():
    _, fwd = _forward("full")
    # per block: q, o 512·512, k, v 256·512, gate, up, down 1024·512 weights, each cast to bf16 (2 B)
    per_block = (2 * 512 * 512 + 2 * 256 * 512 + 3 * 1024 * 512) * 2  # 4,718,592
    assert fwd.parts["autocast_weight_cache"] == 2 * per_block
    assert fwd.parts["head_input_unsaved"] == 1 * 64 * 512 * 4  # the final norm's fp32 output


def test_without_recompute_the_casts_are_saved_activations_already():
    _, fwd = _forward("none")
    assert "autocast_weight_cache" not in fwd.parts and fwd.parts["head_input_unsaved"] == 64 * 512 * 4


@pytest.mark.slow  # one fake-tensor trace, ~3 s
def test_second_micro_batch_forward_equals_trace():
    """--grad-accum 2 with --recompute full: the second micro-batch's forward (every gradient alive, every
    cached cast) is the step's top; it read 2,637,068 B under the trace before the cache was modelled."""
    pytest.importorskip("torch")
    from trainmem.trace import trace_step

    e, _ = _forward("full")
    t = trace_step(CFG, e.step, e.impl)
    assert e.peak_phase == "forward" and t.peak_op == "nll_loss_forward"
    assert e.peak_bytes == t.peak_logical_bytes
