"""``--profile traced`` where what a model keeps is not one polynomial in S, and the every-k peak.

- Chunked linear attention (qwen3_next's gated delta rule pads S to a multiple of 64 and loops
  over the chunks; MiniMax's lightning attention loops over ``block_size`` blocks): traced at the
  estimate's own S and fitted in B alone. Before, fitted at S = 8..40 (one chunk), qwen3_next was
  21% under autograd at S = 256.
- ModernBERT's local window is ``local_attention // 2`` (a config property): its mask changes there.
- ``--recompute every-k``: the checkpointed blocks, not the plain ones, recompute in backward.

Ground truth as in test_traced_profile.py: saved-tensor hooks over a real CPU forward.
"""

from __future__ import annotations

import json
from fractions import Fraction

import pytest

from trainmem.estimate.traced import poly as P
from trainmem.estimate.traced.template import regime_of, seq_loops


def test_fit_at_one_sequence_length_is_linear_in_batch():
    points = [(2, 256), (3, 256)]
    c = P.fit(points, [7 * b * 256 + 5 for b, _ in points])
    assert c == (5, 7 * 256, 0, 0, 0, 0)
    assert P.value(c, 4, 256) == 7 * 4 * 256 + 5
    c1 = P.fit([(1, 96)], [1234])
    assert c1 == (1234, 0, 0, 0, 0, 0) and P.value(c1, 1, 96) == Fraction(1234)


def test_regimes_of_chunked_linear_attention_and_modernbert():
    qwen3_next = {"model_type": "qwen3_next", "layer_types": ["linear_attention", "full_attention"]}
    assert seq_loops(qwen3_next) == "linear_attention"
    assert regime_of(qwen3_next, 4096) == (4096, 4097)  # one S: traced there
    assert seq_loops({"model_type": "gemma3_text", "layer_types": ["sliding_attention", "full_attention"]}) is None
    modernbert = {"model_type": "modernbert", "local_attention": 128}
    assert regime_of(modernbert, 32) == (0, 64)
    assert regime_of(modernbert, 512) == (64, None)


def test_every_k_recompute_names_blocks_across_repeats():
    from trainmem.estimate.peak import recompute_per_layer
    from trainmem.inventory import Category, Inventory, MemoryItem, Repeat

    def item(name, n):
        return MemoryItem.make(name, Category.ACTIVATION, (n,), "uint8", n, f"{n}", (str(n),))

    block = ("mlp.mm", "mlp.silu")
    # without recompute: one template (block 0) for blocks 0-3, the last block apart
    plain = Inventory([], [Repeat(tuple(item(f"m.layers.0.{n}", 10) for n in block), "m.layers.", 0, (0, 1, 2, 3),
                                  shift_previous=False),
                           Repeat(tuple(item(f"m.layers.4.{n}", 10) for n in block), "m.layers.", 4, (4,),
                                  shift_previous=False)])
    # every 2nd block checkpointed (0, 2, 4 keep nothing); 1 and 3 also keep their output, held by the next
    kept = Inventory([], [Repeat((), "m.layers.", 0, (0, 2), shift_previous=False),
                          Repeat(tuple(item(f"m.layers.1.{n}", 10) for n in block) + (item("m.layers.1.add", 4),),
                                 "m.layers.", 1, (1, 3), shift_previous=False),
                          Repeat((), "m.layers.", 4, (4,), shift_previous=False)])
    assert recompute_per_layer(kept, plain) == {0: (20, 10), 2: (20, 10), 4: (20, 10)}


torch = pytest.importorskip("torch")

from trainmem.estimate import estimate  # noqa: E402
from trainmem.specs import ImplSpec, StepSpec  # noqa: E402

TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=512, max_position_embeddings=512)
QWEN3_NEXT = dict(TINY, model_type="qwen3_next", moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2,
                  shared_expert_intermediate_size=64, head_dim=16, linear_key_head_dim=16, linear_value_head_dim=16,
                  linear_num_key_heads=2, linear_num_value_heads=4, layer_types=["linear_attention", "full_attention"])
MODERNBERT = dict(model_type="modernbert", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, vocab_size=512, max_position_embeddings=512, local_attention=32,
                  pad_token_id=0, attention_dropout=0.0, mlp_dropout=0.0, embedding_dropout=0.0)


pytestmark = pytest.mark.usefixtures("traced_cache")  # one TRAINMEM_CACHE per session: tests/conftest.py


def _traced(tmp_path, cfg, B, S, **impl):
    from trainmem.estimate.traced import unmapped_model_spec
    from trainmem.specs.loaders import load_model

    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    model = unmapped_model_spec(str(path)) or load_model(str(path))
    return estimate(model, StepSpec(batch=B, seq=S, precision="bf16"),
                    ImplSpec(profile="traced", device="cpu", routing="balanced", **impl))


def _autograd(cfg, B, S, attention="sdpa") -> int:
    import contextlib

    from trainmem.models.hf import build_hf_model
    from trainmem.specs.impl import routing_hot_fraction
    from trainmem.trace.routing import experts_modules, force_routing
    from trainmem.trace.saved import saved_tensors
    from trainmem.trace.torch_state import default_dtype

    torch.manual_seed(0)
    with default_dtype(torch.bfloat16):
        model = build_hf_model(cfg, attention=attention)
    ids = torch.randint(0, cfg["vocab_size"], (B, S))
    ctx = force_routing(model, routing_hot_fraction("balanced")) if experts_modules(model) else contextlib.nullcontext()
    with ctx:
        saved, loss = saved_tensors(model, lambda: model(ids, labels=ids).loss)
    return sum(s.nbytes for s in saved) + loss.untyped_storage().nbytes()  # and the loss held: loss.value


@pytest.mark.slow  # ~15 s: two traces at S = 160 (three chunks, the last padded), one real forward
def test_qwen3_next_chunked_gated_delta_rule_equals_autograd(tmp_path):
    B, S = 2, 160
    e = _traced(tmp_path, QWEN3_NEXT, B, S, attention="sdpa")
    assert e.totals_bytes["activation"] == _autograd(QWEN3_NEXT, B, S)


@pytest.mark.slow
def test_modernbert_past_its_local_window_equals_autograd(tmp_path):
    B, S = 2, 48  # past the 16-token half window: the sliding mask is materialized
    e = _traced(tmp_path, MODERNBERT, B, S, attention="sdpa")
    assert e.totals_bytes["activation"] == _autograd(MODERNBERT, B, S)


@pytest.mark.slow
def test_every_k_traced_peak_equals_hf_rules(tmp_path):
    from trainmem.specs.loaders import load_model

    cfg = dict(TINY, model_type="llama", num_hidden_layers=5, vocab_size=64)
    path = tmp_path / "llama.json"
    path.write_text(json.dumps(cfg))
    step = StepSpec(batch=2, seq=128, precision="bf16")
    impl = dict(device="cpu", attention="sdpa", recompute="every-k", recompute_every=2)
    traced = estimate(load_model(str(path)), step, ImplSpec(profile="traced", **impl))
    ruled = estimate(load_model(str(path)), step, ImplSpec(profile="hf", **impl))
    # before: blocks 1 and 3 (not checkpointed) were taken to recompute, and block 1 to run last
    assert traced.peak.bytes == ruled.peak.bytes
    assert [(p.name, p.bytes) for p in traced.phases] == [(p.name, p.bytes) for p in ruled.phases]
