"""A 4-bit MLP's backward moments (estimate/quant4bit_moments.py): the dequantized weight sits in its 4-bit matmuls'
moments, not beside the MLP product's or the RMSNorms' nodes. Tiny Llama (h64, F176, 4/2 heads, V128, 2 layers) bf16
QLoRA r 8 on q/v (the MLP frozen 4-bit), AdamW, against a fake-tensor trace of the real bitsandbytes + peft model.
Before, with the weight added to every backward phase: full recompute B1 S8 7,424 B over, B1 S16 14,848 B over,
B1 / B2 S64 22,528 B over; eager, the backward phase B1 S8 8,448 B and B1 S16 16,896 B over. Now equal. The eager
steps' peak is now the forward phase's bound (the activations so far plus one dequantized block weight): B1 S8
2,408 B and B1 S16 4,808 B over the trace, whose top is the down projection's 4-bit matmul in backward."""

from __future__ import annotations

import pytest

from trainmem.estimate import estimate
from trainmem.specs import ImplSpec, StepSpec
from trainmem.specs.finetune import FinetuneSpec
from trainmem.specs.loaders import spec_from_hf_config

pytest.importorskip("bitsandbytes")

LLAMA = dict(model_type="llama", hidden_size=64, intermediate_size=176, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, vocab_size=128)
QLORA = FinetuneSpec(mode="qlora", lora_rank=8)


def _case(batch, seq, recompute):
    return (StepSpec(batch=batch, seq=seq, precision="bf16", optimizer="adamw"),
            ImplSpec(attention="sdpa", device="cpu", recompute=recompute))


def test_checkpointed_up_projection_moment_as_integers():
    step, impl = _case(1, 16, "full")
    e = estimate(spec_from_hf_config(LLAMA), step, impl, finetune=QLORA)
    first = {p.name: p for p in e.phases}["backward_first_block"]
    R, prod, weight, x = 16 * 64 * 2, 16 * 176 * 2, 176 * 64 * 2, 16 * 64 * 2
    # the residual gradient, SiLU's waiting gradient and up's output gradient, the dequantized up weight, its input
    # gradient; the loss and its seed (8)
    assert first.parts["node_work"] == R + 2 * prod + weight + x + 8
    assert "dequant_temporary" not in first.parts and e.peak_phase == "backward_first_block"


@pytest.mark.slow  # one fake-tensor trace each (bitsandbytes on CPU), ~1-3 s
@pytest.mark.parametrize("batch,seq,recompute,phase", [
    (1, 8, "full", None), (1, 16, "full", None), (1, 64, "full", None), (2, 64, "full", None),
    (1, 8, "none", "backward"), (1, 16, "none", "backward")])
def test_qlora_backward_equals_trace(batch, seq, recompute, phase):
    """``phase``: the trace's top is that phase's (eager, small S: the down projection's 4-bit matmul); the step's
    estimate is then the forward phase's bound on the blocks' 4-bit matmuls, above it."""
    from trainmem.trace import trace_step

    step, impl = _case(batch, seq, recompute)
    t = trace_step(LLAMA, step, impl, finetune=QLORA)
    e = estimate(spec_from_hf_config(LLAMA), step, impl, finetune=QLORA)
    got = {p.name: p.bytes for p in e.phases}[phase] if phase else e.peak_bytes
    assert got == t.peak_logical_bytes
    if phase:
        assert t.peak_op == "mm" and e.peak_bytes > t.peak_logical_bytes
