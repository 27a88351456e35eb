"""GPT-2's forward moment inside its last block (estimate/decoder_forward.py): with a classification head the
logits are B·S·3, so the step's top is the last block's MLP residual add, not the loss.

Tiny GPT-2 (n_embd 64, 2 layers, 4 heads, V256, 3 labels; AdamW for-loop, CPU kernels, amp-bf16): the estimate
read its backward (seq-cls B1 S64: 3,084,048 B), 8,952 B under the trace's forward top (3,093,000 B at
``transformer.h.1``'s ``add``); B2 S32 760 B under, B2 S64 17,408 B; token-cls B1 S64 5,362 B under.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from trainmem.estimate.decoder_forward import residual_add_transients, with_decoder_forward
from trainmem.specs import ImplSpec, StepSpec
from trainmem.specs.loaders import spec_from_hf_config

GPT2 = dict(model_type="gpt2", n_embd=64, n_layer=2, n_head=4, vocab_size=256, n_positions=512)
IMPL = ImplSpec(device="cpu", optimizer_impl="for-loop")


def test_residual_add_transients_as_integers():
    # B2 S32 H64 under autocast: inputs_embeds 2·32·64·4 = 16,384 + position_embeds 32·64·4 = 8,192; the attention
    # and MLP outputs in bf16, 2·32·64·2 = 8,192 each; ln_2's fp32 output (c_fc saves a bf16 cast) 16,384
    assert residual_add_transients(B=2, S=32, H=64, act="bfloat16", compute="float32", norm_saved=False) == {
        "input_embeddings": 24576, "attn_output": 8192, "ln_2_output": 16384, "mlp_output": 8192}
    # fp32: c_fc saves ln_2's output itself
    assert residual_add_transients(B=1, S=64, H=64, act="float32", compute="float32", norm_saved=True) == {
        "input_embeddings": 32768, "attn_output": 16384, "ln_2_output": 0, "mlp_output": 16384}


def _peak(cfg, head, step, impl=IMPL):
    from trainmem.estimate import estimate
    spec = spec_from_hf_config(cfg)
    if head != "lm":
        spec = replace(spec, head=head, num_labels=3)
    e = estimate(spec, step, impl)
    # with_decoder_forward is idempotent: the same whether estimate() applies it already or not
    return max(with_decoder_forward(list(e.phases), e.inventory, spec, step, impl), key=lambda p: p.bytes)


def _trace(cfg, head, step, impl=IMPL):
    from trainmem.trace import trace_step
    return trace_step(cfg, step, impl, **({} if head == "lm" else {"head": head})).peak_logical_bytes


@pytest.mark.parametrize("head,batch,seq,expected", [
    ("seq-cls", 1, 64, 3_093_000), ("seq-cls", 2, 32, 2_887_952), ("token-cls", 1, 64, 3_093_540)])
def test_classifier_peak_is_the_last_residual_add(head, batch, seq, expected):
    pytest.importorskip("torch")
    cfg = {**GPT2, "num_labels": 3}
    step = StepSpec(batch=batch, seq=seq, precision="amp-bf16")
    p = _peak(cfg, head, step)
    assert (p.name, p.bytes) == ("forward", expected)
    assert p.bytes == _trace(cfg, head, step)


@pytest.mark.slow  # 36 fake-tensor traces, ~1 s each
@pytest.mark.parametrize("head", ["seq-cls", "token-cls", "lm"])
@pytest.mark.parametrize("precision", ["fp32", "bf16", "amp-bf16"])
@pytest.mark.parametrize("batch,seq", [(1, 32), (1, 64), (2, 32), (2, 64)])
def test_gpt2_heads_equal_trace(head, precision, batch, seq):
    """Every head, precision and shape of the scan: the moment never over-reads (fp32, bf16, the LM heads: the loss
    or backward stays the top)."""
    pytest.importorskip("torch")
    cfg = {**GPT2, "num_labels": 3} if head != "lm" else GPT2
    step = StepSpec(batch=batch, seq=seq, precision=precision)
    assert _peak(cfg, head, step).bytes == _trace(cfg, head, step)
