"""BERT's forward phase (estimate/encoder_forward.py, estimate/forward_held.py ``_encoder_held``): the largest of the
loss's moment, the last block's math attention output cast and its last LayerNorm, equal to a CPU fake-tensor
trace's forward top. Before: tiny BERT (h64, F128, 2 layers, A4, V256) token-cls bf16 B1 S64 -6,908 B, amp-bf16
-15,864 B; seq-cls amp-bf16 B1 S64 -65,260 B; mlm amp-bf16 B1 S64 -18,296 B, mlm fp32 B1 S64 +520 B (the shifted
target a causal LM keeps, which BERT's MLM loss does not make)."""

from __future__ import annotations

import dataclasses
from dataclasses import replace

import pytest

from trainmem.estimate.encoder_forward import autocast_held, core_transients, norm_transients
from trainmem.specs import ImplSpec, StepSpec
from trainmem.specs.loaders import spec_from_hf_config

BERT = dict(model_type="bert", hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            vocab_size=256, max_position_embeddings=512, num_labels=3)
IMPL = ImplSpec(device="cpu", optimizer_impl="for-loop")


def test_core_transients_as_integers():
    bsh = 1 * 64 * 64
    # bf16, B1: q/k/v outputs (3·BSH·2), query_acc and key_acc (2·BSH·4), attn.to(bf16) (B·A·S²·2), bmm's fp32
    # output and its cast (BSH·4 + BSH·2)
    assert core_transients(B=1, S=64, H=64, A=4, act="bfloat16") == {
        "qkv_outputs": 3 * bsh * 2, "qk_upcast": 2 * bsh * 4, "fold_copies_inputs": 0,
        "attn_weights_cast": 4 * 64 * 64 * 2, "core_output": bsh * 4 + bsh * 2}
    # fp32, B1: only q's and k's outputs (v is value_acc, saved) and the output
    assert sum(core_transients(B=1, S=64, H=64, A=4, act="float32").values()) == 2 * bsh * 4 + bsh * 4
    # B2: matmul's reshape copies: the scaled q and value_acc unsaved (bf16), the scaled q and v (fp32)
    bsh2 = 2 * 64 * 64
    assert core_transients(B=2, S=64, H=64, A=4, act="bfloat16")["fold_copies_inputs"] == 2 * bsh2 * 4
    assert core_transients(B=2, S=64, H=64, A=4, act="float32") == {
        "qkv_outputs": 3 * bsh2 * 4, "qk_upcast": 0, "fold_copies_inputs": bsh2 * 4, "attn_weights_cast": 0,
        "core_output": bsh2 * 4}


def test_norm_and_autocast_held_as_integers():
    assert norm_transients(B=2, S=32, H=64, act="bfloat16", compute="float32") == {
        "dropout_output": 2 * 32 * 64 * 2, "norm_output": 2 * 32 * 64 * 4}
    assert autocast_held(B=1, S=64, H=64, layers=2, at_norm=True) == 3 * 64 * 64 * 4  # embeddings, block input, attn
    assert autocast_held(B=1, S=64, H=64, layers=1, at_norm=False) == 64 * 64 * 4  # one block: the same tensor


@pytest.mark.slow  # 18 fake-tensor traces
@pytest.mark.parametrize("batch,seq", [(1, 64), (2, 32)])
@pytest.mark.parametrize("precision", ["fp32", "bf16", "amp-bf16"])
@pytest.mark.parametrize("head", ["mlm", "seq-cls", "token-cls"])
def test_bert_forward_phase_equals_trace(head, precision, batch, seq):
    from tests.estimate.test_optimizer_impl import _phase_peaks
    from trainmem.estimate import estimate
    from trainmem.estimate.attention import kernel_for
    from trainmem.estimate.encoder_forward import with_encoder_forward
    from trainmem.trace import trace_step

    spec, step = replace(spec_from_hf_config(BERT), head=head, num_labels=3), StepSpec(batch=batch, seq=seq,
                                                                                       precision=precision)
    e = estimate(spec, step, IMPL)
    # idempotent: estimate() applies it too (patch-bert-1 on estimate/__init__.py)
    e = dataclasses.replace(e, phases=tuple(with_encoder_forward(list(e.phases), e.inventory, spec, step, IMPL,
                                                                 kernel_for(spec, step, IMPL))))
    t = trace_step(BERT, step, IMPL, head=head)
    assert {p.name: p.bytes for p in e.phases}["forward"] == _phase_peaks(t, "forward")[0]


@pytest.mark.parametrize("head,labels", [("token-cls", 32 * 8), ("seq-cls", 8)])
def test_classifier_labels_alive_at_the_end_of_backward(head, labels):
    """The caller holds a classifier's labels all step (phase_parts.shared_block_inputs no longer takes them for the
    blocks' shared inputs): tiny BERT fp32 B1 S32's backward_end was 256 B (token-cls) / 8 B (seq-cls) under the
    trace's last backward moment, the embedding's, now equal (the 36-case sweep of this module: 0 at backward_end)."""
    from trainmem.estimate import estimate

    spec = replace(spec_from_hf_config(BERT), head=head, num_labels=3)
    end = {p.name: p for p in estimate(spec, StepSpec(batch=1, seq=32, precision="fp32"), IMPL).phases}["backward_end"]
    assert end.parts["activations"] == 32 * 8 + labels  # the embedding's saved ids and the caller's labels
