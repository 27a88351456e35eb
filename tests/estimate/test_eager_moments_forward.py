"""The loss's forward moment (estimate/forward_held.py) and a tied head beside a larger position table
(estimate/peak.py ``_head_weight_grad``), issue 13.

At the loss's forward (aten ``nll_loss_forward``) the trace holds, beyond the saved set and the logits, the
DynamicCache's K/V copies no node saved, autocast's cached bias copies, the final norm's unsaved output under
autocast and ForCausalLMLoss's padded labels. Before, tiny GPT-NeoX amp-bf16 (h128, 2 layers, V128) B2 S64 /
S96 was 71,696 / 187,920 B under the trace's peak, a tiny Llama (h64, 2 layers, 4/2 heads, V128) amp-bf16 B2
S64 33,808 B under and Qwen2 34,320 B; every HF forward phase missed the padded labels (1,040 B at B2 S64).
A tied GPT-2 at V 128 counted its position table's gradient (512·128·4) as the tied head's: B1 S32 was
393,216 B over in fp32 and amp-bf16, 196,608 B in bf16."""

from __future__ import annotations

import pytest

from trainmem.estimate import estimate
from trainmem.specs import ImplSpec, StepSpec
from trainmem.specs.loaders import spec_from_hf_config

NEOX = dict(model_type="gpt_neox", hidden_size=128, intermediate_size=512, num_hidden_layers=2,
            num_attention_heads=4, vocab_size=128, max_position_embeddings=512)
GPT2 = dict(model_type="gpt2", n_embd=128, n_layer=2, n_head=4, vocab_size=128, n_positions=512)
LLAMA = dict(model_type="llama", hidden_size=64, intermediate_size=176, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, vocab_size=128)
QWEN2 = {**LLAMA, "model_type": "qwen2"}


def _estimate(cfg, precision, batch, seq, recompute="none"):
    return estimate(spec_from_hf_config(cfg), StepSpec(batch=batch, seq=seq, precision=precision, optimizer="sgd"),
                    ImplSpec(attention="sdpa", device="cpu", recompute=recompute))


def _trace(cfg, step, recompute="none"):
    pytest.importorskip("torch")
    from trainmem.trace import trace_step

    return trace_step(cfg, step, ImplSpec(attention="sdpa", device="cpu", recompute=recompute))


def _forward(e):
    return next(p for p in e.phases if p.name == "forward").parts


def test_neox_autocast_forward_extras_as_integers():
    parts = _forward(_estimate(NEOX, "amp-bf16", 2, 64))
    one = 2 * 64 * 128 * 4  # a (B, S, H) fp32 tensor: 65,536 B
    assert parts["kv_cache_unsaved"] == 2 * one  # each layer's rotated K, fp32 (SDPA saved its bf16 cast)
    # query_key_value (3H), dense (H), dense_h_to_4h (4H), dense_4h_to_h (H) biases in bf16, two layers
    assert parts["autocast_bias_cache"] == 2 * (3 * 128 + 128 + 512 + 128) * 2
    assert parts["head_input_unsaved"] == one  # the final LayerNorm's fp32 output (lm_head saved its cast)
    assert parts["padded_labels"] == 2 * 65 * 8


def test_forward_extras_by_precision():
    """fp32 GPT-2 eager: bmm reads the cache's V as it is (saved, ``v_repeat``), not its K (a transposed
    copy): one (B, S, H) copy per layer; Llama fp32 saves both (SDPA reads them); B = 1 pads in place."""
    assert _forward(_estimate(GPT2, "fp32", 2, 64))["kv_cache_unsaved"] == 2 * 2 * 64 * 128 * 4
    llama = _forward(_estimate(LLAMA, "fp32", 2, 64))
    assert "kv_cache_unsaved" not in llama and llama["padded_labels"] == 1040
    assert "padded_labels" not in _forward(_estimate(LLAMA, "fp32", 1, 64))
    # under autocast the rotated K is fp32 (B·S·Akv·hd·4 per layer); Qwen2's q/k/v biases are cached in bf16
    qwen = _forward(_estimate(QWEN2, "amp-bf16", 2, 64))
    assert qwen["kv_cache_unsaved"] == 2 * 2 * 64 * 32 * 4 and qwen["autocast_bias_cache"] == 2 * (64 + 32 + 32) * 2
    # checkpointing turns the cache off (transformers' *Model.forward: use_cache = False)
    assert "kv_cache_unsaved" not in _forward(_estimate(LLAMA, "amp-bf16", 2, 64, "full"))


def test_tied_gpt2_sums_its_token_table_not_its_positions():
    e = _estimate(GPT2, "fp32", 1, 32)
    end = next(p for p in e.phases if p.name == "backward_end").parts
    G, tied = sum(i.bytes for i in e.inventory if i.category.value == "gradient"), 128 * 128 * 4
    assert end["gradients"] == G - tied + 3 * tied  # the head's and the embedding's gradients and their sum


#: (config, precision, batch, seq, recompute, the trace's top op): each case's estimate before (B, + over)
CASES = [
    (NEOX, "amp-bf16", 2, 64, "none", "nll_loss_forward"),  # -71,696
    (NEOX, "amp-bf16", 2, 96, "none", "nll_loss_forward"),  # -187,920
    (LLAMA, "amp-bf16", 2, 64, "none", "nll_loss_forward"),  # -33,808
    (QWEN2, "amp-bf16", 2, 64, "none", "nll_loss_forward"),  # -34,320
    (GPT2, "fp32", 1, 32, "none", "add"),  # +393,216: the tied sum at the end of backward
    (GPT2, "bf16", 1, 32, "full", "add"),  # +196,608
    (GPT2, "amp-bf16", 1, 32, "none", "add"),  # +393,216
]


@pytest.mark.slow  # one fake-tensor trace each, ~0.3-2 s
@pytest.mark.parametrize("cfg,precision,batch,seq,recompute,op", CASES)
def test_estimate_equals_trace(cfg, precision, batch, seq, recompute, op):
    t = _trace(cfg, StepSpec(batch=batch, seq=seq, precision=precision, optimizer="sgd"), recompute)
    e = _estimate(cfg, precision, batch, seq, recompute)
    assert (t.peak_op, e.peak_bytes) == (op, t.peak_logical_bytes), e.peak_phase


@pytest.mark.slow
@pytest.mark.parametrize("cfg,precision", [(GPT2, "fp32"), (GPT2, "bf16"), (GPT2, "amp-bf16"), (NEOX, "fp32"),
                                           (LLAMA, "bf16"), (QWEN2, "amp-bf16")])
def test_forward_phase_equals_the_trace_at_the_loss(cfg, precision):
    """The forward phase is the trace's live bytes once nll_loss_forward made its total weight (B2 S64), or, where
    that is larger, once GPT-2's last block made its residual add's output (estimate/decoder_forward.py: fp32)."""
    from trainmem.trace.result import item_names

    t = _trace(cfg, StepSpec(batch=2, seq=64, precision=precision, optimizer="sgd"))
    rec, live, at = t.recording, 0, {}
    names = item_names(rec)
    for ev in rec.events:
        b = rec.blocks[ev if ev >= 0 else ~ev]
        live += b.nbytes if ev >= 0 else -b.nbytes
        if ev >= 0 and names[b.id] in ("nll_loss_forward:1", "transformer.h.1.add:1"):
            at[names[b.id]] = live
    assert sum(_forward(_estimate(cfg, precision, 2, 64)).values()) == max(at.values())
