"""What a decoder's classification forward holds at its loss beyond the saved set (estimate/heads.py
``classifier_forward_held``, read by estimate/forward_held.py): the final norm's output, bound by the model output,
and the token classifier's dropout output, where the head saves something else; besides them the KV cache's copies
and autocast's bias copies, as for an LM head.

Tiny untied Llama and Phi-3 (h64, F128, 2 layers, V256, 3 labels; AdamW for-loop, CPU kernels) token-cls under
amp-bf16: the step's top is the loss's forward (``nll_loss_forward``), 9,722 B over the estimate's (its backward):
the forward phase lacked 49,158 B = the KV cache's unsaved fp32 copies (2 × 8,192), the final norm's fp32 output
(16,384), the dropout's output (16,384) and the classifier bias's bf16 copy (3 · 2 = 6).
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from trainmem.estimate.heads import classifier_forward_held
from trainmem.specs import ImplSpec, StepSpec
from trainmem.specs.loaders import spec_from_hf_config

LLAMA = dict(model_type="llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=256, max_position_embeddings=512, num_labels=3)
PHI3 = {**LLAMA, "model_type": "phi3", "pad_token_id": 0}
IMPL = ImplSpec(device="cpu", optimizer_impl="for-loop")


def _spec(cfg, head):
    return replace(spec_from_hf_config(cfg), head=head, num_labels=3)


@pytest.mark.parametrize("head,precision,expected", [
    ("token-cls", "amp-bf16", 2 * 64 * 64 * 4),  # the norm's fp32 output and the dropout's: the classifier saves a cast
    ("token-cls", "bf16", 64 * 64 * 2),  # the norm's output: the dropout saves its mask, the classifier its output
    ("seq-cls", "amp-bf16", 64 * 64 * 4),  # the norm's output: score saves its bf16 cast
    ("seq-cls", "bf16", 0),  # score saves the norm's output itself
    ("lm", "amp-bf16", 0)])  # an LM head's: forward_held.head_input_unsaved
def test_classifier_forward_held_as_integers(head, precision, expected):
    assert classifier_forward_held(_spec(LLAMA, head), StepSpec(batch=1, seq=64, precision=precision)) == expected


@pytest.mark.parametrize("cfg", [LLAMA, PHI3], ids=["llama", "phi3"])
@pytest.mark.parametrize("batch,seq", [(1, 64), (2, 32)])
def test_token_cls_autocast_peak_equals_trace(cfg, batch, seq):
    pytest.importorskip("torch")
    from trainmem.estimate import estimate
    from trainmem.trace import trace_step

    step = StepSpec(batch=batch, seq=seq, precision="amp-bf16")
    e = estimate(_spec(cfg, "token-cls"), step, IMPL)
    t = trace_step(cfg, step, IMPL, head="token-cls")
    assert (e.peak_bytes, e.peak_phase) == (t.peak_logical_bytes, "forward")


BERT = dict(model_type="bert", hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            vocab_size=256, max_position_embeddings=512, num_labels=3)


@pytest.mark.parametrize("head,precision,expected", [
    ("token-cls", "fp32", 64 * 64 * 4),  # the last LayerNorm's output: the dropout saves its mask, the classifier its out
    ("token-cls", "bf16", 64 * 64 * 2),
    ("token-cls", "amp-bf16", 2 * 64 * 64 * 4),  # layer_norm's fp32 output and the dropout's: the classifier saves a cast
    ("seq-cls", "fp32", 0),  # the pooler's addmm saves the first token's view: the whole output, an activation
    ("seq-cls", "amp-bf16", 64 * 64 * 4)])  # ... under autocast a bf16 copy of that row: the fp32 output is held
def test_bert_classifier_forward_held_as_integers(head, precision, expected):
    # read by estimate/forward_held.py for BERT's classifiers too (test_bert_token_cls_forward_equals_trace)
    assert classifier_forward_held(_spec(BERT, head), StepSpec(batch=1, seq=64, precision=precision)) == expected


@pytest.mark.slow  # one fake-tensor trace
def test_bert_token_cls_forward_equals_trace():
    """BERT token-cls fp32: the forward phase's top == the trace's (16,384 B under before forward_held read
    BERT's classifier). bf16 and amp-bf16: tests/estimate/test_encoder_forward.py (the last block's moments)."""
    from tests.estimate.test_optimizer_impl import _phase_peaks
    from trainmem.estimate import estimate
    from trainmem.trace import trace_step

    step = StepSpec(batch=1, seq=64, precision="fp32")
    e = estimate(_spec(BERT, "token-cls"), step, IMPL)
    t = trace_step(BERT, step, IMPL, head="token-cls")
    assert {p.name: p.bytes for p in e.phases}["forward"] == _phase_peaks(t, "forward")[0]
