"""``--profile traced``: what the model's output holds through the loss though no gradient reads it
(traced/record.py ``_output_held``), the forward phase's ``kv_cache_unsaved`` (estimate/forward_held.py).

transformers builds a cache in a training forward (``use_cache`` defaults to True) and the output holds it until
the caller drops it, after the loss. MiniMax's cache keeps each lightning-attention layer's last
``attn_weights_inter`` (``modeling_minimax.py`` ``MiniMaxLightningAttention.forward``), (B, h, d, d), and through
its graph the last block's ``K.T @ V`` inputs, the contiguous copies the matmul saved: (B, h, d, blk) and
(B, h, blk, d), blk the last block's length. A ``DynamicCache``'s K/V copies that attention does not save (Llama
under autocast: SDPA saves bf16 casts of the fp32 cache copies) are the same measure, which the hf rules model
on their own (forward_held.py ``_CacheProbe``).
"""

from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")

from trainmem.estimate import estimate  # noqa: E402
from trainmem.estimate.traced import unmapped_model_spec  # noqa: E402
from trainmem.specs import ImplSpec, StepSpec  # noqa: E402
from trainmem.specs.loaders import load_model  # noqa: E402
from trainmem.trace import trace_step  # noqa: E402

pytestmark = pytest.mark.usefixtures("traced_cache")  # one TRAINMEM_CACHE per session: tests/conftest.py

#: bench/families.py's MiniMax row (tiny_families widened to hidden 256), where the gap was found
MINIMAX = dict(model_type="minimax", hidden_size=256, intermediate_size=512, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, head_dim=64, vocab_size=512, max_position_embeddings=512,
               pad_token_id=0, num_local_experts=4, num_experts_per_tok=2, attention_dropout=0.0,
               layer_types=["full_attention", "linear_attention"])
LLAMA = dict(model_type="llama", hidden_size=64, intermediate_size=176, num_hidden_layers=8, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=256, max_position_embeddings=1024)


def _forward(e):
    return next(p for p in e.phases if p.name == "forward")


@pytest.mark.slow  # ~4 s alone: a traced estimate at hidden 256, S=256, and a fake-tensor trace of the step
def test_minimax_lightning_state_is_held_through_the_loss(tmp_path):
    # measured: the estimate's peak was 73,744 B under the trace's (its forward phase 589,824 B under: this)
    B, S = 2, 256
    path = tmp_path / "config.json"
    path.write_text(json.dumps(MINIMAX))
    step = StepSpec(batch=B, seq=S, precision="bf16")
    e = estimate(unmapped_model_spec(str(path)), step, ImplSpec(profile="traced", device="cpu", attention="sdpa"))
    h, d = MINIMAX["num_attention_heads"], MINIMAX["head_dim"]
    blk = S - (S - 1) // 256 * 256  # config.block_size 256: the last block's length
    per_layer = (B * h * d * d + B * h * d * blk + B * h * blk * d) * 2  # bf16
    assert _forward(e).parts["kv_cache_unsaved"] == MINIMAX["layer_types"].count("linear_attention") * per_layer
    fake = trace_step(MINIMAX, step, ImplSpec(attention="sdpa", device="cpu"))
    assert (e.peak.name, fake.peak_phase) == ("forward", "forward")
    assert e.peak_bytes == fake.peak_logical_bytes


@pytest.mark.slow  # ~3 s alone: Llama cut to its first blocks, traced at seven (B, S)
def test_traced_cache_bytes_are_the_hf_rules_under_autocast(tmp_path):
    # each kind's block's share counted once per block of its kind (template.py output_bytes)
    path = tmp_path / "config.json"
    path.write_text(json.dumps(LLAMA))
    step = StepSpec(batch=2, seq=64, precision="amp-bf16")
    traced = _forward(estimate(load_model(str(path)), step, ImplSpec(profile="traced", device="cpu")))
    hf = _forward(estimate(load_model(str(path)), step, ImplSpec(device="cpu")))
    assert traced.parts["kv_cache_unsaved"] == hf.parts["kv_cache_unsaved"] > 0
