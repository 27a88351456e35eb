"""Gradient accumulation's transients (estimate/grad_accum.py): from the second micro-batch on every
parameter has a ``.grad`` and each new gradient is a tensor of its own until ``AccumulateGrad`` adds
it in place (``torch/csrc/autograd/functions/accumulate_grad.h``). Before, the estimate was under the
trace (``--device cpu``, logical bytes) on the tiny models of test_tied_in_backward.py (B1, S16):
untied Llama fp32 SGD ga2 by 1,027,964 B and amp-bf16 by 513,916 B at the head's backward, tied
GPT-2 (h128, V1000) amp-bf16 by 323,964 B there, every tied case by 4 B (the divided loss), and a
tied Llama h512 V1000 bf16 S128 by 535,032 B at the final norm's backward. All equal now, at
grad-accum 2 and 4, with and without full recompute; the trace equals a real CPU step."""

from __future__ import annotations

import pytest

from trainmem.estimate import estimate
from trainmem.specs import ImplSpec, StepSpec
from trainmem.specs.loaders import spec_from_hf_config

LLAMA = dict(model_type="llama", hidden_size=64, intermediate_size=172, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, vocab_size=8000, tie_word_embeddings=False)
TIED = {**LLAMA, "tie_word_embeddings": True}
GPT2 = dict(model_type="gpt2", n_embd=128, n_layer=2, n_head=4, vocab_size=1000, n_positions=64)
WIDE_TIED = dict(model_type="llama", hidden_size=512, intermediate_size=1024, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, vocab_size=1000, tie_word_embeddings=True)
IMPL = ImplSpec(device="cpu")
T = 8000 * 64 * 4  # the head's (and the embedding's) weight gradient, fp32


def _est(cfg, precision="fp32", accum=2, seq=16, recompute="none", optimizer="sgd"):
    return estimate(spec_from_hf_config(cfg), StepSpec(batch=1, seq=seq, precision=precision, optimizer=optimizer,
                                                        grad_accum=accum), ImplSpec(device="cpu", recompute=recompute))


def _phase(est, name):
    return next(p for p in est.phases if p.name == name)


def test_untied_head_moment_as_integers():
    e = _est(LLAMA)
    head = _phase(e, "head_backward")
    # every stored .grad, the new head gradient, the logits' gradient (B·S·V·4) and the input gradient
    assert head.parts["gradients"] == e.totals_bytes["gradient"]
    assert head.parts["new_gradient"] == T and head.parts["logits_grad"] == 16 * 8000 * 4
    assert head.parts["work"] == 16 * 64 * 4
    assert head.parts["loss_scalars"] == 8 and head.parts["accum_loss"] == 4  # loss, seed, loss / N
    assert e.peak_phase == "head_backward"
    # the embedding's new gradient at the end of backward, beside its .grad
    assert _phase(e, "backward_end").parts["new_gradient"] == T
    one = _est(LLAMA, accum=1)
    assert "head_backward" not in {p.name for p in one.phases}
    assert "new_gradient" not in _phase(one, "backward_end").parts
    assert _est(LLAMA, accum=4).peak_bytes == e.peak_bytes  # the number of micro-batches does not matter


def test_autocast_head_holds_the_low_gradient_and_its_cast():
    head = _phase(_est(LLAMA, "amp-bf16"), "head_backward")
    assert head.parts["new_gradient"] == T // 2 + T  # bf16 mm output and its fp32 cast (ToCopyBackward0)
    assert "logits_grad" not in head.parts and head.parts["work"] == 16 * 64 * 4


def test_tied_head_gradient_waits_through_the_blocks():
    e = _est(TIED)
    for name in ("backward", "backward_first_block"):
        assert _phase(e, name).parts["tied_pending"] == T
    assert "new_gradient" not in _phase(e, "backward_end").parts  # the sum's moment, counted at N = 1 too
    assert "tied_pending" not in _phase(_est(TIED, accum=1), "backward").parts


def test_final_norm_moment():
    e = _est(WIDE_TIED, "bf16", seq=128)
    ph = _phase(e, "head_backward")
    x = 128 * 512 * 4  # the norm's fp32 input
    assert ph.parts["node_work"] == 5 * x and ph.parts["tied_pending"] == 1000 * 512 * 2
    assert e.peak_phase == "head_backward" and "final RMSNorm" in ph.note


CASES = [
    (LLAMA, "fp32", 2, "none", "sgd", 16), (LLAMA, "fp32", 4, "full", "sgd", 16),
    (LLAMA, "amp-bf16", 2, "none", "sgd", 16), (LLAMA, "amp-bf16", 4, "full", "sgd", 16),
    (TIED, "fp32", 2, "none", "sgd", 16), (TIED, "bf16", 4, "full", "adamw", 16),
    (TIED, "mixed-bf16", 2, "none", "sgd", 16),
    (GPT2, "fp32", 2, "none", "adamw", 16), (GPT2, "bf16", 4, "none", "sgd", 16),
    (GPT2, "amp-bf16", 2, "none", "sgd", 16), (GPT2, "amp-bf16", 4, "none", "adamw", 16),
    (WIDE_TIED, "bf16", 2, "none", "sgd", 128),
]


@pytest.mark.slow  # one trace each, ~3-8 s on 2 shared cores
@pytest.mark.parametrize("cfg,precision,accum,recompute,optimizer,seq", CASES)
def test_estimate_equals_trace(cfg, precision, accum, recompute, optimizer, seq):
    pytest.importorskip("torch")
    from trainmem.trace import trace_step

    step = StepSpec(batch=1, seq=seq, precision=precision, optimizer=optimizer, grad_accum=accum)
    impl = ImplSpec(device="cpu", recompute=recompute)
    est, t = estimate(spec_from_hf_config(cfg), step, impl), trace_step(cfg, step, impl)
    assert est.peak_bytes == t.peak_logical_bytes, (est.peak_phase, est.peak_bytes, t.peak_logical_bytes)


@pytest.mark.slow  # a trace and two real optimizer steps of two micro-batches
@pytest.mark.parametrize("precision", ["fp32", "amp-bf16"])
def test_trace_equals_a_real_step(precision):
    """The loop the trace runs (trace/step.py ``one_step``), on real CPU tensors (tests/estimate/real_steps.py):
    the live storages' peak over the second optimizer step (SGD: no states) is the trace's."""
    pytest.importorskip("torch")
    from real_steps import real_step  # tests/estimate/real_steps.py
    from trainmem.trace import trace_step

    step = StepSpec(batch=1, seq=16, precision=precision, optimizer="sgd", grad_accum=2)
    peak, counters = real_step(LLAMA, step, IMPL)
    t = trace_step(LLAMA, step, IMPL)
    assert counters == 0 and peak == t.peak_logical_bytes
    assert t.peak_logical_bytes == estimate(spec_from_hf_config(LLAMA), step, IMPL).peak_bytes


@pytest.mark.slow  # two real LoRA optimizer steps of two micro-batches and one trace, ~10 s each
@pytest.mark.parametrize("precision,peak", [("fp32", 909_132), ("amp-bf16", 822_604)])
def test_lora_full_recompute_equals_a_real_step(precision, peak):
    """LoRA (peft's q/v), --grad-accum 2, --recompute full, tiny Llama h64 B1 S64: the estimate, a real CPU step's
    live storages and the trace agree (fp32 909,132 B, amp-bf16 822,604 B; AdamW's host step counters left out, as
    the trace leaves them out). transformers' checkpointing makes the frozen embedding's output a leaf that requires a
    gradient (``PreTrainedModel.enable_input_require_grads``); ``ModTracker``'s multi-grad hooks once kept that
    leaf and its ``.grad`` alive past their micro-batch (a reference cycle through ``AccumulateGrad``), so the
    trace read 2·B·S·H·4 = 32,768 B more (941,900 / 855,372 B). The recorder now removes those hooks once they have fired
    (trace/mod_tracker_hooks.py)."""
    pytest.importorskip("torch")
    pytest.importorskip("peft")
    from real_steps import real_step  # tests/estimate/real_steps.py
    from trainmem.specs.finetune import FinetuneSpec
    from trainmem.trace import trace_step
    from trainmem.trace.finetune import apply_finetune
    from trainmem.trace.recompute import enable_recompute

    cfg = dict(LLAMA, vocab_size=128, intermediate_size=176)
    spec, ft = spec_from_hf_config(cfg), FinetuneSpec(mode="lora", lora_rank=8)
    impl = ImplSpec(attention="sdpa", device="cpu", recompute="full")
    step = StepSpec(batch=1, seq=64, precision=precision, optimizer="adamw", grad_accum=2)
    # as the trace: checkpointing first, then peft
    real, counters = real_step(cfg, step, impl, prepare=lambda model: enable_recompute(model, impl),
                               wrap=lambda model: apply_finetune(model, ft.for_model(spec), spec))
    e = estimate(spec, step, impl, finetune=ft)
    assert real - counters == e.peak_bytes == peak
    assert trace_step(cfg, step, impl, finetune=ft).peak_logical_bytes == e.peak_bytes
