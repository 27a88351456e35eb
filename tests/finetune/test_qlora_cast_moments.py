"""QLoRA's 4-bit matmuls under a cast (estimate/quant4bit_moments.py, estimate/adapter_forward.py): ``amp-bf16`` and
``fp32`` steps keep fp32 weights, so bitsandbytes' ``dequantize_4bit`` returns the weight in fp32 and
``MatMul4Bit.backward``'s ``.to(grad_output.dtype)`` copies it to bf16, both alive at once; ``Linear4bit`` casts
its input to bf16 and its output back. Tiny Llama (h64, F176, 4/2 heads, V128, 2 layers) QLoRA r 8 on q/v (the MLP
frozen 4-bit), AdamW, against a fake-tensor trace of the real bitsandbytes + peft model. Before (one bf16 weight
added to every backward phase): full recompute B1 S8 / S16 25,344 / 5,632 B under, B1 / B2 S64 22,528 B over (both
precisions); eager amp-bf16 B1 S8 / S16 17,304 / 7,992 B under, B2 S64 7,688 B over; eager fp32 B1 S8 / S16
29,184 / 13,312 B under, B1 / B2 S64 22,528 B over. Now equal."""

from __future__ import annotations

import pytest

from trainmem.estimate import estimate
from trainmem.specs import ImplSpec, StepSpec
from trainmem.specs.finetune import FinetuneSpec
from trainmem.specs.loaders import spec_from_hf_config

pytest.importorskip("bitsandbytes")

LLAMA = dict(model_type="llama", hidden_size=64, intermediate_size=176, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, vocab_size=128)
QLORA = FinetuneSpec(mode="qlora", lora_rank=8)  # bf16 compute dtype, double quantization (bitsandbytes' defaults)


def _case(precision, batch, seq, recompute):
    return (StepSpec(batch=batch, seq=seq, precision=precision, optimizer="adamw"),
            ImplSpec(attention="sdpa", device="cpu", recompute=recompute))


def _phases(precision, batch, seq, recompute):
    return {p.name: p for p in estimate(spec_from_hf_config(LLAMA), *_case(precision, batch, seq, recompute),
                                        finetune=QLORA).phases}


@pytest.mark.parametrize("precision", ["amp-bf16", "fp32"])
def test_checkpointed_up_projection_cast_moment_as_integers(precision):
    first = _phases(precision, 1, 16, "full")["backward_first_block"]
    # the fp32 residual gradient, SiLU's waiting fp32 gradient, up's output gradient cast to bf16, then
    # dequantize_4bit's fp32 up weight and its bf16 copy (above the absmax 704 + fp32 weight and the bf16 weight +
    # its 16·64·2 input gradient); the loss and its seed (8)
    R, act_grad, up_grad, w32, w16 = 16 * 64 * 4, 16 * 176 * 4, 16 * 176 * 2, 176 * 64 * 4, 176 * 64 * 2
    assert first.parts["node_work"] == R + act_grad + up_grad + w32 + w16 + 8 == 88_584
    assert "dequant_temporary" not in first.parts


def test_last_down_projection_forward_moment_as_integers():
    fwd = _phases("amp-bf16", 2, 64, "none")["forward"]
    # Linear4bit on the product (128·176, fp32): its bf16 cast (45,056) beside it (90,112) and the MLP's fp32
    # input (32,768, saved by no 4-bit projection); then gemm_4bit's bf16 output (16,384) beside the larger of the
    # fp32 absmax (11,264/64·4 = 704) + the bf16 dequantized weight (22,528) and the output's fp32 cast (32,768)
    assert fwd.parts["block_locals"] == 32_768 + 90_112 + 45_056
    assert fwd.parts["dequant_temporary"] == 16_384 + max(704 + 22_528, 32_768)
    assert "logits" not in fwd.parts  # made after the blocks


@pytest.mark.slow  # one fake-tensor trace each (bitsandbytes on CPU), ~1-3 s
@pytest.mark.parametrize("precision", ["amp-bf16", "fp32"])
@pytest.mark.parametrize("batch,seq,recompute", [
    (1, 8, "full"), (1, 16, "full"), (1, 64, "full"), (2, 64, "full"), (1, 8, "none"), (1, 16, "none"),
    (2, 64, "none")])
def test_qlora_cast_step_equals_trace(precision, batch, seq, recompute):
    """The tops: full recompute, the first block's up projection (fp32 and bf16 weight) at S8 / S16 and the MLP
    product's node at S64; eager, the up projection of block 0 at S8 / S16; at B2 S64 the last down projection's
    output cast in the forward (amp-bf16), the product's node (fp32)."""
    from trainmem.trace import trace_step

    step, impl = _case(precision, batch, seq, recompute)
    t = trace_step(LLAMA, step, impl, finetune=QLORA)
    e = estimate(spec_from_hf_config(LLAMA), step, impl, finetune=QLORA)
    assert e.peak_bytes == t.peak_logical_bytes


@pytest.mark.slow
def test_forward_gemm_moment_is_above_the_trace_by_the_hidden_dequantization():
    """amp-bf16 eager B1 S64: the trace's top is the loss (``nll_loss_forward``); the estimate's is the last down
    projection's ``gemm_4bit``, whose absmax and dequantized weight (704 + 22,528 B, made inside the op, which the
    fake-tensor trace runs as one) exceed the output's fp32 cast (64·64·4 = 16,384 B) the trace sees there by
    6,848 B; 432 B over the trace's top."""
    from trainmem.trace import trace_step

    step, impl = _case("amp-bf16", 1, 64, "none")
    t = trace_step(LLAMA, step, impl, finetune=QLORA)
    e = estimate(spec_from_hf_config(LLAMA), step, impl, finetune=QLORA)
    assert e.peak_phase == "forward" and t.peak_op == "nll_loss_forward"
    assert e.peak_bytes - t.peak_logical_bytes == 432


def test_dequant_transient_under_a_cast_as_integers():
    """With the MLP adapted (no 4-bit node moments) every backward phase carries the largest weight dequantized to
    fp32 and its bf16 copy (MatMul4Bit.backward), the forward's gemm_4bit only the bf16 one (``backward=``)."""
    from trainmem.estimate.finetune import dequant_transient, with_dequant_transient
    from trainmem.estimate.phase import Phase

    model = spec_from_hf_config(LLAMA)
    assert dequant_transient(model, QLORA)[0] == 176 * 64 * 2
    assert dequant_transient(model, QLORA, weight_dtype="bfloat16")[0] == 176 * 64 * 2  # no copy: the same dtype
    assert dequant_transient(model, QLORA, weight_dtype="float32")[0] == 176 * 64 * (4 + 2) == 67_584
    phases = [Phase("forward", 10, {"logits": 0}, ""), Phase("backward", 10, {"work": 10}, "")]
    got = with_dequant_transient(phases, *dequant_transient(model, QLORA),
                                 backward=dequant_transient(model, QLORA, weight_dtype="float32"))
    assert [p.parts["dequant_temporary"] for p in got] == [22_528, 67_584]
