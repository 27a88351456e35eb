"""QLoRA's dequantized weight where the MLP carries adapters or stays 16-bit (estimate/quant4bit_moments.py).

Tiny Llama (h64, F176, 4/2 heads, V128, 2 layers) QLoRA r 8, AdamW, against a fake-tensor trace of the real
bitsandbytes + peft model. Before, one dequantized weight was added to every backward phase, at the MLP product's
and the RMSNorms' nodes too, which run no 4-bit matmul:

* every linear adapted (``lora_targets=all-linear``, every linear 4-bit), bf16: full recompute B1 S16 / S64,
  B2 S16 / S64 11,776 / 22,528 / 22,528 / 22,528 B over; eager B1 S16 13,312 B over (the backward phase),
  B1 S64 5,888, B2 S16 14,208 B over; with a 4-bit head the same. Now the adapted down projection's
  ``MatMul4Bit.backward`` is a node moment and the others hold no weight: equal (eager B1 S16: the backward phase
  equals the trace's top, the forward phase's bound is 1,224 B above it; with the 4-bit head, equal).
* ``qlora_scope='targeted'`` (q/v 4-bit, the MLP 16-bit): full recompute 8,192 B over (one dequantized q_proj)
  at every B and S, eager B1 S16 4,032 B over; equal now, bf16 and amp-bf16.

The forward phase holds one dequantized block weight beside the activations (the last down projection's
``gemm_4bit``), which the fake-tensor trace, running ``gemm_4bit`` as one op, cannot see. At B1 S8 (not in the grid
below) the trace's top is the same down-projection moment, and its peak is 2,624 B above the logical bytes of the
tensors it lists alive there, which the backward phase equals: not explained yet.

* every linear adapted under amp-bf16 (fp32 weights dequantized to fp32, copied to bf16): B1/B2 x S16/S64 x
  eager/full were 4,088-46,336 B over; the down projection's 4-bit matmul and, after it, its input-gradient sum
  (three fp32 products) are node moments now: equal.

* the same in fp32 steps (fp32 adapters on an fp32 product: one shared residual gradient, lora_A's product gradient
  uncast, the product itself freed by lora_A's node): was 20,480-67,584 B over; equal now.

Not modelled: an adapted 4-bit MLP with adapter dropout (the masks change the moments, already
8,704-120,840 B under the trace at full recompute).
"""

from __future__ import annotations

import pytest

from trainmem.estimate import estimate
from trainmem.specs import ImplSpec, StepSpec
from trainmem.specs.finetune import FinetuneSpec
from trainmem.specs.loaders import spec_from_hf_config

pytest.importorskip("bitsandbytes")

LLAMA = dict(model_type="llama", hidden_size=64, intermediate_size=176, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, vocab_size=128)
ALL = FinetuneSpec(mode="qlora", lora_rank=8, lora_targets=("all-linear",))
SCOPES = {"all-linear": ALL,
          "all-linear+head": FinetuneSpec(mode="qlora", lora_rank=8, lora_targets=("all-linear",), quantize_head=True),
          "targeted": FinetuneSpec(mode="qlora", lora_rank=8, qlora_scope="targeted")}


def _case(batch, seq, recompute, precision="bf16"):
    return (StepSpec(batch=batch, seq=seq, precision=precision, optimizer="adamw"),
            ImplSpec(attention="sdpa", device="cpu", recompute=recompute))


def _phases(ft, *case):
    return {p.name: p for p in estimate(spec_from_hf_config(LLAMA), *_case(*case), finetune=ft).phases}


def test_adapted_down_projection_moment_as_integers():
    back = _phases(ALL, 1, 16, "none")["backward"]
    R, prod, w, absmax = 16 * 64 * 2, 16 * 176 * 2, 64 * 176 * 2, 11_264 // 64 * 4
    # the residual gradient and the base branch's, lora_A's product gradient (bf16), then the dequantized down
    # weight beside the larger of its fp32 absmax and its input gradient; the loss and its seed (8)
    assert back.parts["node_work"] == 2 * R + prod + w + max(absmax, prod) + 8 == 37_896
    # the down adapters' weight gradients (fp32): lora_A 8·176·4, lora_B 64·8·4
    assert back.parts["gradients"] == 8 * 176 * 4 + 64 * 8 * 4 == 7_680
    assert "dequant_temporary" not in back.parts


def test_adapted_down_projection_autocast_moment_as_integers():
    back = _phases(ALL, 1, 16, "none", "amp-bf16")["backward"]
    R, prod32, copy, w32, w16 = 16 * 64 * 4, 16 * 176 * 4, 16 * 64 * 2, 64 * 176 * 4, 64 * 176 * 2
    # one fp32 residual gradient (the branches share it under autocast), lora_A's fp32 product gradient, the output
    # gradient's bf16 copy, dequantize_4bit's fp32 weight and its bf16 copy; the loss and its seed (8)
    assert back.parts["node_work"] == R + prod32 + copy + w32 + w16 + 8 == 85_000


def test_adapted_down_projection_fp32_moment_as_integers():
    back = _phases(ALL, 1, 16, "none", "fp32")["backward"]
    R, prod32, copy, w32, w16 = 16 * 64 * 4, 16 * 176 * 4, 16 * 64 * 2, 64 * 176 * 4, 64 * 176 * 2
    # as under autocast; the product (saved by lora_A itself, 11,264) is freed with the adapters' saved tensors
    assert back.parts["node_work"] == R + prod32 + copy + w32 + w16 + 8 == 85_000


def test_checkpointed_adapted_block_holds_no_weight_beside_its_nodes():
    first = _phases(ALL, 2, 64, "full")["backward_first_block"]
    assert "node_work" in first.parts and "dequant_temporary" not in first.parts


def test_adapter_dropout_is_not_this_layout():
    """peft's dropout masks and outputs change the moment (not modelled: the weight stays in every backward phase;
    all-linear r 8 dropout 0.1 was 20,984-53,240 B under the trace eager at S64 before and after this change)."""
    ft = FinetuneSpec(mode="qlora", lora_rank=8, lora_targets=("all-linear",), lora_dropout=0.1)
    assert _phases(ft, 1, 16, "none")["backward"].parts["dequant_temporary"] == 176 * 64 * 2


@pytest.mark.parametrize("recompute", ["none", "full"])
def test_targeted_16_bit_mlp_nodes_hold_no_weight(recompute):
    for p in _phases(SCOPES["targeted"], 1, 16, recompute).values():
        if "node_work" in p.parts:
            assert "dequant_temporary" not in p.parts


@pytest.mark.slow  # one fake-tensor trace each (bitsandbytes on CPU), ~1-3 s
@pytest.mark.parametrize("scope", list(SCOPES))
@pytest.mark.parametrize("batch,seq", [(1, 16), (1, 64), (2, 16), (2, 64)])
@pytest.mark.parametrize("recompute", ["none", "full"])
def test_bf16_step_equals_trace(scope, batch, seq, recompute):
    """Eager all-linear B1 S16: the trace's top is the last down projection's 4-bit matmul in backward, which the
    backward phase equals; the step's estimate is the forward phase's bound, 1,224 B above (with a 4-bit head the
    forward holds the head's weight beside the logits instead, below)."""
    from trainmem.trace import trace_step

    step, impl = _case(batch, seq, recompute)
    ft = SCOPES[scope]
    t = trace_step(LLAMA, step, impl, finetune=ft)
    e = estimate(spec_from_hf_config(LLAMA), step, impl, finetune=ft)
    if scope == "all-linear" and (batch, seq, recompute) == (1, 16, "none"):
        assert {p.name: p.bytes for p in e.phases}["backward"] == t.peak_logical_bytes
        assert e.peak_phase == "forward" and e.peak_bytes - t.peak_logical_bytes == 1_224
    else:
        assert e.peak_bytes == t.peak_logical_bytes


@pytest.mark.slow
@pytest.mark.parametrize("precision,scope", [("amp-bf16", "all-linear"), ("amp-bf16", "targeted"),
                                             ("fp32", "all-linear")])
@pytest.mark.parametrize("batch,seq", [(1, 16), (1, 64), (2, 16), (2, 64)])
@pytest.mark.parametrize("recompute", ["none", "full"])
def test_cast_step_equals_trace(precision, scope, batch, seq, recompute):
    """all-linear full recompute B1 / B2 S64: the top is the down projection's input-gradient sum (``add``)."""
    from trainmem.trace import trace_step

    step, impl = _case(batch, seq, recompute, precision)
    ft = SCOPES[scope]
    assert estimate(spec_from_hf_config(LLAMA), step, impl, finetune=ft).peak_bytes == \
        trace_step(LLAMA, step, impl, finetune=ft).peak_logical_bytes
