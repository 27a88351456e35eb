"""estimate/selective_moments.py: the bytes a block releases before its attention core is recomputed
(``--recompute selective``), and what the step reads with them (estimate/backward_moments.py, patch pending).

Tiny GPT-NeoX (h128, F512, 4 heads, 2 layers, V128, parallel residual) and tiny Llama (h64, F176, 4/2 heads), LoRA
r 8 (peft's default targets), AdamW, sdpa, CPU fake-tensor traces. Before (estimate - trace): GPT-NeoX LoRA fp32
B1 S32 +33,016 B, B2 S64 +132,600 B; bf16 B1 S32 +8,576 B, B2 S64 +34,816 B; amp-bf16 B1 S32 +5,872 B, B2 S64
+127,464 B; full fine-tuning fp32 / bf16 / amp-bf16 B2 S64 +132,088 / +66,808 / +99,320 B. With the working set less
these bytes: bf16 equal; fp32 and amp-bf16 S·8 B under (one int64 (S,) position_ids, which GPTNeoXLayer passes to
the attention function in its kwargs and the selective checkpoint holds until the first block's attention backward),
now in the selective saved set (rules_hf._gpt): fp32 and amp-bf16 LoRA and full fine-tuning equal at B1 S32, B1 S64
and B2 S64 (−256 / −512 / −512 B before), GPT-2 LoRA amp-bf16 B1 S32 / S64 too (−256 / −512 B before). Llama LoRA and
full fine-tuning: unchanged (equal at S64)."""

from __future__ import annotations

import pytest

from trainmem.estimate import estimate
from trainmem.estimate.selective_moments import saved_after_attention
from trainmem.specs import ImplSpec, StepSpec
from trainmem.specs.finetune import FinetuneSpec
from trainmem.specs.loaders import spec_from_hf_config

NEOX = dict(model_type="gpt_neox", hidden_size=128, intermediate_size=512, num_hidden_layers=2,
            num_attention_heads=4, vocab_size=128, max_position_embeddings=512)
LORA = FinetuneSpec(mode="lora", lora_rank=8)


def _case(precision, batch, seq):
    return StepSpec(batch=batch, seq=seq, precision=precision, optimizer="adamw"), \
        ImplSpec(attention="sdpa", device="cpu", recompute="selective")


def _traced_and_estimated(cfg, step, impl, finetune=None):
    """(the fake-tensor trace, the estimate) of one step."""
    pytest.importorskip("torch")
    from trainmem.trace import trace_step

    return trace_step(cfg, step, impl, finetune=finetune), estimate(spec_from_hf_config(cfg), step, impl,
                                                                    finetune=finetune)


def test_neox_saved_after_attention_as_integers():
    e = estimate(spec_from_hf_config(NEOX), *_case("fp32", 1, 32), finetune=LORA)
    # post_attention_layernorm's mean and rstd (2 · 32 · 4), dense_h_to_4h's output (the frozen MLP's one saved
    # tensor, 32 · 512 · 4) and the block's output (32 · 128 · 4)
    assert saved_after_attention(e.inventory, 1) == 2 * 32 * 4 + 32 * 512 * 4 + 32 * 128 * 4 == 82_176


@pytest.mark.slow  # one fake-tensor trace each
@pytest.mark.parametrize("batch,seq", [(1, 32), (2, 64)])
def test_neox_lora_selective_bf16_equals_trace(batch, seq):
    t, e = _traced_and_estimated(NEOX, *_case("bf16", batch, seq), LORA)
    # the top: the last block's fused QKV adapter in the forward (estimate/adapter_forward.py)
    assert (t.peak_op, e.peak_phase, e.peak_bytes) == ("mul", "forward", t.peak_logical_bytes)


@pytest.mark.parametrize("recompute,held", [("selective", 32 * 8), ("none", 0)])
def test_neox_selective_holds_position_ids(recompute, held):
    step = StepSpec(batch=2, seq=32, precision="fp32", optimizer="adamw")
    e = estimate(spec_from_hf_config(NEOX), step, ImplSpec(attention="sdpa", device="cpu", recompute=recompute),
                 finetune=LORA)
    # one (1, S) int64 position_ids, shared by both blocks' attention checkpoints: 32 · 8 = 256, not over B
    assert sum(i.bytes for i in e.inventory if i.name == "model.position_ids") == held


@pytest.mark.slow  # one fake-tensor trace each
@pytest.mark.parametrize("lora,batch,seq", [(True, 1, 32), (False, 2, 64)])
@pytest.mark.parametrize("precision", ["fp32", "amp-bf16"])
def test_neox_selective_position_ids_equal_trace(lora, batch, seq, precision):
    t, e = _traced_and_estimated(NEOX, *_case(precision, batch, seq), LORA if lora else None)
    # S·8 B under before the checkpoint held the ids (256 / 512 B); full fine-tuning runs at B2 S64, where the
    # backward tops
    assert (e.peak_phase, e.peak_bytes) == (t.peak_phase, t.peak_logical_bytes)


GPT2 = dict(model_type="gpt2", n_embd=64, n_layer=2, n_head=4, vocab_size=128, n_positions=128)


def test_gpt2_math_core_moment_as_integers():
    from trainmem.estimate.selective_moments import math_core_moments
    step, impl = _case("amp-bf16", 2, 64)
    e = estimate(spec_from_hf_config(GPT2), step, impl)
    # the recomputed saved set: q, kᵀ, value_acc (3 · 2·4·64·16 · 4) and softmax, dropout's mask and output
    # (3 · 2·4·64·64 · 4) = 98,304 + 393,216 = 491,520; its largest, the fp32 score, 131,072
    (m,) = math_core_moments(e.inventory, 1, kernel="math", residual_bytes=2 * 64 * 64 * 4,
                             recomputed=(491_520, 131_072))
    # the residual and the core output's fp32 gradients (32,768 each), the saved set, the (S, S) fp32 mask (16,384),
    # query_acc and key_acc (2 · 32,768), the bf16 weights' cast (65,536) and the scaled q before its copy (32,768)
    assert m["work"] == 32_768 + 32_768 + 491_520 + 16_384 + 65_536 + 65_536 + 32_768 == 737_280
    # c_proj's, ln_2's and the MLP's fp32 gradients: 16,384 + 256 + 256 + 256 + 65,536 + 1,024 + 65,536 + 256
    assert m["block_gradients"] == 149_504


def test_gpt2_math_core_moment_not_for_eager():
    from trainmem.estimate.selective_moments import math_core_moments
    step = StepSpec(batch=2, seq=64, precision="amp-bf16", optimizer="adamw")
    e = estimate(spec_from_hf_config(GPT2), step, ImplSpec(attention="eager", device="cpu", recompute="selective"))
    # eager attention (transformers' own matmuls and its (B, 1, S, S) mask): not SDPA's math path
    assert math_core_moments(e.inventory, 1, kernel="eager", residual_bytes=32_768, recomputed=(491_520, 131_072)) == []


@pytest.mark.slow  # one fake-tensor trace each
@pytest.mark.parametrize("lora,batch,seq", [(True, 1, 32), (True, 1, 64), (True, 2, 64), (False, 1, 32), (False, 1, 64),
                                            (False, 2, 64)])
@pytest.mark.parametrize("precision", ["amp-bf16", "bf16", "fp32"])
def test_gpt2_selective_math_core_equals_trace(precision, lora, batch, seq):
    t, e = _traced_and_estimated(GPT2, *_case(precision, batch, seq), LORA if lora else None)
    # before (the recomputed core's working set on the math kernel): amp-bf16 full fine-tuning B1 S32 / B1 S64 /
    # B2 S64 -7,688 / -113,400 / -151,792 B, LoRA B2 S64 -57,352 B; bf16 full -21,248 / -91,144 / -123,912 B,
    # LoRA B1 S64 / B2 S64 -24,584 / -65,544 B. fp32 was equal (the MLP's moment tops) and stays so
    assert e.peak_bytes == t.peak_logical_bytes


LLAMA = dict(model_type="llama", hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=128, max_position_embeddings=256)


def test_llama_math_core_moment_as_integers():
    from trainmem.estimate.selective_moments import math_core_moments
    step = StepSpec(batch=2, seq=64, precision="bf16", optimizer="adamw")
    impl = ImplSpec(attention="sdpa-math", device="cpu", recompute="selective")
    e = estimate(spec_from_hf_config(LLAMA), step, impl)
    # the recomputed saved set: the scaled q's copy, kᵀ, the repeated V (3 · 2·4·64·16 · 4), softmax (2·4·64·64 · 4)
    (m,) = math_core_moments(e.inventory, 1, kernel="math", residual_bytes=2 * 64 * 64 * 2,
                             recomputed=(229_376, 131_072))
    # the residual gradient (16,384), the core output's fp32 gradient (32,768), the (S, S) fp32 mask (16,384),
    # query_acc (32,768), key_acc and value_acc at 2 K/V heads (2 · 16,384), key_acc repeated (32,768), the scaled q
    # before its copy (32,768); at the mask's add: q, kᵀ, V (3 · 32,768), the score and its masked copy (2 · 131,072)
    assert m["work"] == 16_384 + 32_768 + 16_384 + 32_768 + 32_768 + 32_768 + 32_768 + 98_304 + 262_144 == 557_056
    # o_proj's, post_attention_layernorm's and the MLP's bf16 gradients: 8,192 + 128 + 3 · 22,528
    assert m["block_gradients"] == 8_192 + 128 + 3 * 22_528


@pytest.mark.slow  # one fake-tensor trace each
@pytest.mark.parametrize("attention", ["sdpa-math", "sdpa"])
@pytest.mark.parametrize("lora,batch", [(False, 1), (False, 2), (True, 1), (True, 2)])
@pytest.mark.parametrize("precision", ["bf16", "amp-bf16", "fp32"])
def test_llama_selective_math_core_equals_trace(precision, lora, batch, attention):
    step = StepSpec(batch=batch, seq=64, precision=precision, optimizer="adamw")
    impl = ImplSpec(attention=attention, device="cpu", recompute="selective")
    t, e = _traced_and_estimated(LLAMA, step, impl, LORA if lora else None)
    # before (sdpa-math: q after RoPE and K/V at 2 heads through enable_gqa, no moment): bf16 / amp-bf16 full B2 S64
    # -124,160 / -114,160 B; sdpa (fused, no fp32 score) was equal and stays so
    assert e.peak_bytes == t.peak_logical_bytes


def test_gpt2_core_backward_moment_as_integers():
    from trainmem.estimate.selective_moments import math_core_moments
    step, impl = _case("fp32", 2, 128)
    e = estimate(spec_from_hf_config(GPT2), step, impl)
    # the recomputed set read without the KV cache: q, kᵀ, V's bmm copy (3 · 2·4·128·16 · 4) and softmax, dropout's
    # mask and output (3 · 2·4·128·128 · 4) = 196,608 + 1,572,864; the cached V is a view for bmm: no copy
    (m,) = math_core_moments(e.inventory, 1, kernel="math", residual_bytes=2 * 128 * 64 * 4,
                             recomputed=(1_769_472, 524_288))
    # P·V's backward: the residual gradient (65,536), the output's gradient (65,536), q, kᵀ (2 · 65,536), softmax,
    # dropout's mask and output (3 · 524,288), V's gradient (65,536) and P's (524,288)
    assert m["work"] == 65_536 + 65_536 + 131_072 + 1_572_864 + 65_536 + 524_288 == 2_424_832


@pytest.mark.slow  # one fake-tensor trace each
@pytest.mark.parametrize("precision,batch,lora", [("fp32", 2, False), ("bf16", 2, False), ("amp-bf16", 2, False),
                                                  ("fp32", 1, False), ("bf16", 2, True), ("fp32", 1, True)])
def test_gpt2_selective_core_backward_equals_trace(precision, batch, lora):
    t, e = _traced_and_estimated(GPT2, *_case(precision, batch, 128), LORA if lora else None)
    # the trace's top is P·V's backward in block 1 (dP's bmm); before, full fine-tuning: -83,976 / -65,536 /
    # -65,536 / -149,512 B (the core's backward beside dropout's mask and output, V's and P's gradients: not modelled)
    assert (t.peak_op, t.peak_module.removeprefix("base_model.model.")) == ("bmm", "transformer.h.1.attn")
    assert e.peak_bytes == t.peak_logical_bytes


@pytest.mark.parametrize("precision,device,attention,kernel", [
    ("fp32", "cpu", "sdpa", "math"),  # GPT-2's attention dropout: only math takes dropout on CPU
    ("bf16", "cuda", "sdpa", "flash"), ("fp32", "cuda", "sdpa", "efficient"), ("amp-bf16", "cuda", "sdpa", "flash"),
    ("bf16", "cpu", "eager", "eager"), ("bf16", "cuda", "sdpa-math", "math")])
def test_kernel_for(precision, device, attention, kernel):
    from trainmem.estimate.attention import kernel_for
    step = StepSpec(batch=1, seq=32, precision=precision)
    assert kernel_for(spec_from_hf_config(GPT2), step, ImplSpec(attention=attention, device=device)) == kernel


def test_phase_inputs_refuse_unknown_kernel():
    from trainmem.estimate.phase_inputs import PhaseInputs
    with pytest.raises(ValueError, match="attention_kernel='mystery'"):
        PhaseInputs(batch=1, seq=8, vocab=8, logits_dtype="float32", loss_dtype="float32", loss="ce", grad_accum=1,
                    residual_bytes=0, optimizer_transient=(0, ""), attention_kernel="mystery")


PHI3 = dict(model_type="phi3", hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=4, vocab_size=128, max_position_embeddings=256, attention_dropout=0.1, pad_token_id=0)


@pytest.mark.slow  # one fake-tensor trace each
@pytest.mark.parametrize("precision,batch,seq", [("fp32", 2, 128), ("bf16", 2, 128), ("fp32", 1, 128), ("bf16", 1, 32)])
def test_phi3_selective_math_core_equals_trace(precision, batch, seq):
    t, e = _traced_and_estimated(PHI3, *_case(precision, batch, seq))
    # Phi-3's attention dropout runs CPU SDPA on math; its fused qkv_proj's gradient comes after the core's backward.
    # Before: -180,488 / -40,960 / -147,720 B (no P·V backward moment) and bf16 B1 S32 +24,576 B (qkv_proj's bf16
    # gradient, 64 · 192 · 2, counted at the core's moments)
    assert e.peak_bytes == t.peak_logical_bytes
