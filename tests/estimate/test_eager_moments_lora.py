"""LoRA's eager block moment (estimate/block_backward.py): with the MLP frozen (peft's default targets q/v), its
down projection saves no input, so ``act_fn(gate) * up``'s MulBackward0 runs with up_proj's output still saved
and nothing of the MLP freed but the block's output. Fine-tuning's zero-byte markers (what a frozen layer does
not save) no longer hide the block's layout from the moments.

Tiny Llama (h64, F176, 2 layers, 4/2 heads, V128), LoRA r 8 on q/v, AdamW, CPU fake-tensor traces: fp32 B1 / B2
S64 were 36,608 / 73,216 B under the trace's top (block 1's ``mul``), with full recompute 73,736 / 147,464 B, bf16
full recompute 45,064 / 90,120 B; now equal. (The caller's ids, B·S·8, are counted too: estimate/peak.py.)
Under amp-bf16 the top is the loss's forward (estimate/forward_held.py): B1 / B2 were 18,952 / 36,880 B under
(the rotated fp32 K cache, the final norm's fp32 output, block 0's cached lora_A copies), now equal."""

from __future__ import annotations

import pytest

from trainmem.estimate import estimate
from trainmem.estimate.block_backward import norm_backward_parts
from trainmem.specs import ImplSpec, StepSpec
from trainmem.specs.finetune import FinetuneSpec
from trainmem.specs.loaders import spec_from_hf_config

LLAMA = dict(model_type="llama", hidden_size=64, intermediate_size=176, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, vocab_size=128)
LORA = FinetuneSpec(mode="lora", lora_rank=8)


def _estimate(precision, batch, recompute="none"):
    return estimate(spec_from_hf_config(LLAMA), StepSpec(batch=batch, seq=64, precision=precision, optimizer="adamw"),
                    ImplSpec(attention="sdpa", device="cpu", recompute=recompute), finetune=LORA)


def test_frozen_mlp_product_moment_as_integers():
    e = _estimate("fp32", 1)
    r, prod = 64 * 64 * 4, 64 * 176 * 4  # the residual gradient 16,384 B; a (B, S, F) tensor 45,056 B
    mul, down = norm_backward_parts(e.inventory, 1, r)
    # down_proj's input gradient and MulBackward0's two beside the residual gradient; only the block's output
    # (the final norm's input, released by its node) freed: gate's, act's and up's outputs still saved
    assert mul == {"block_gradients": 0, "freed_activations": r, "after_attention": 0, "work": r + 3 * prod}
    # before it, the end of down_proj's MmBackward0: its input gradient alone, no weight gradient
    assert down == {"block_gradients": 0, "new_gradients": 0, "freed_activations": r, "after_attention": 0,
                    "work": r + prod}
    assert {p.name: p for p in e.phases}["backward"].parts["caller_ids"] == 64 * 8  # frozen embedding: the caller's


@pytest.mark.slow  # one fake-tensor trace each, ~0.5 s
@pytest.mark.parametrize("precision,batch,recompute", [("fp32", 1, "none"), ("fp32", 2, "none"), ("fp32", 1, "full"),
                                                       ("fp32", 2, "full"), ("bf16", 1, "full"), ("bf16", 2, "full")])
def test_lora_estimate_equals_trace(precision, batch, recompute):
    pytest.importorskip("torch")
    from trainmem.trace import trace_step

    step = StepSpec(batch=batch, seq=64, precision=precision, optimizer="adamw")
    t = trace_step(LLAMA, step, ImplSpec(attention="sdpa", device="cpu", recompute=recompute), finetune=LORA)
    e = _estimate(precision, batch, recompute)
    assert (t.peak_module, t.peak_op) == ("base_model.model.model.layers.1.mlp", "mul")
    assert (e.peak_phase, e.peak_bytes) == ("backward", t.peak_logical_bytes)


@pytest.mark.slow
def test_lora_autocast_recomputed_product_equals_trace():
    """amp-bf16, full recompute, B 2: the frozen down projection saves its bf16 weight copy after the MLP's last
    tensor (its input gradient reads it), which the product's moment frees with the node; was 34,824 B under."""
    pytest.importorskip("torch")
    from trainmem.trace import trace_step

    step = StepSpec(batch=2, seq=64, precision="amp-bf16", optimizer="adamw")
    t = trace_step(LLAMA, step, ImplSpec(attention="sdpa", device="cpu", recompute="full"), finetune=LORA)
    e = _estimate("amp-bf16", 2, "full")
    assert (t.peak_op, e.peak_phase, e.peak_bytes) == ("mul", "backward", t.peak_logical_bytes)


@pytest.mark.slow
@pytest.mark.parametrize("batch", [1, 2])
def test_lora_autocast_forward_equals_trace(batch):
    pytest.importorskip("torch")
    from trainmem.trace import trace_step

    step = StepSpec(batch=batch, seq=64, precision="amp-bf16", optimizer="adamw")
    t = trace_step(LLAMA, step, ImplSpec(attention="sdpa", device="cpu"), finetune=LORA)
    e = _estimate("amp-bf16", batch)
    # q's and v's lora_A copies in block 0 (8 x 64 x 2 each): its input, the frozen embedding's output, needs no
    # gradient, so neither saves its copy; autocast's cache holds them to the end of the forward
    assert {p.name: p for p in e.phases}["forward"].parts["autocast_unsaved_casts"] == 2 * 8 * 64 * 2
    assert (t.peak_op, e.peak_phase, e.peak_bytes) == ("nll_loss_forward", "forward", t.peak_logical_bytes)


@pytest.mark.slow  # one fake-tensor trace each, ~1-3 s
@pytest.mark.parametrize("batch,grad_accum", [(1, 1), (1, 2), (2, 1)])
def test_lora_selective_product_moment_equals_trace(batch, grad_accum):
    """--recompute selective checkpoints the attention core alone: the MLP's backward runs before its recomputation,
    so the frozen MLP's product moment reads the block's saved set as an eager block's does (estimate/peak.py
    ``attention_recompute``). fp32 B1 S64 was 36,608 B under the trace (with --grad-accum 2 too), B2 S64 73,216 B;
    now equal."""
    pytest.importorskip("torch")
    from trainmem.trace import trace_step

    step = StepSpec(batch=batch, seq=64, precision="fp32", optimizer="adamw", grad_accum=grad_accum)
    impl = ImplSpec(attention="sdpa", device="cpu", recompute="selective")
    t = trace_step(LLAMA, step, impl, finetune=LORA)
    e = estimate(spec_from_hf_config(LLAMA), step, impl, finetune=LORA)
    assert (t.peak_module, t.peak_op) == ("base_model.model.model.layers.1.mlp", "mul")
    assert (e.peak_phase, e.peak_bytes) == ("backward", t.peak_logical_bytes)
