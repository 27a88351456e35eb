"""``--recompute selective`` on SDPA's math kernel with a q that RoPE made contiguous (estimate/selective_moments.py
``_rope_by_cat``): Phi-3's ``apply_rotary_pos_emb`` ends in ``torch.cat``, so the kernel's scaled q folds into bmm's
(B·A, S, hd) batch as a view and no copy of it is made at B > 1 (Llama's elementwise RoPE keeps the (B, S, A, hd)
layout, and matmul copies it).

Tiny Phi-3 (h64, F128, 4 heads, 2 layers, V128, attention dropout 0.1, so CPU SDPA runs math), AdamW: amp-bf16
B2 S64 read 32,768 B (the copy, 2·4·64·16·4) over the trace's top, the core's recompute in block 1.
"""

from __future__ import annotations

import pytest

from trainmem.estimate import estimate
from trainmem.estimate.selective_moments import math_core_moments
from trainmem.specs import ImplSpec, StepSpec
from trainmem.specs.loaders import spec_from_hf_config

PHI3 = dict(model_type="phi3", hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=4, vocab_size=128, max_position_embeddings=256, attention_dropout=0.1, pad_token_id=0)
IMPL = ImplSpec(attention="sdpa", device="cpu", recompute="selective")


def _step(precision="amp-bf16", batch=2, seq=64):
    return StepSpec(batch=batch, seq=seq, precision=precision, optimizer="adamw")


def test_phi3_math_core_moment_as_integers():
    e = estimate(spec_from_hf_config(PHI3), _step(), IMPL)
    # the recomputed saved set: q, k, V (3 · 2·4·64·16 · 4) and softmax, dropout's mask and output (3 · 2·4·64·64 · 4)
    (m,) = math_core_moments(e.inventory, 1, kernel="math", residual_bytes=2 * 64 * 64 * 4,
                             recomputed=(491_520, 131_072))
    # the residual and the core output's fp32 gradients (32,768 each), autocast's bf16 casts of the fp32 RoPE'd q and
    # k (2 · 16,384), the (S, S) fp32 mask (16,384), query_acc and key_acc (2 · 32,768), the saved set and the
    # weights' bf16 cast (65,536); no copy of the scaled q (it was 32,768 more)
    assert m["work"] == 32_768 + 32_768 + 32_768 + 16_384 + 65_536 + 491_520 + 65_536 == 737_280


@pytest.mark.slow  # one fake-tensor trace each
@pytest.mark.parametrize("seq", [64, 128])
def test_phi3_selective_amp_equals_trace(seq):
    from trainmem.trace import trace_step
    step = _step(seq=seq)
    t, e = trace_step(PHI3, step, IMPL), estimate(spec_from_hf_config(PHI3), step, IMPL)
    assert (e.peak_phase, e.peak_bytes) == (t.peak_phase, t.peak_logical_bytes)
