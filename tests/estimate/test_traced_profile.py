"""``--profile traced`` (estimate/traced): exact fits, the hand-written rules held to the trace to the
byte, and the traced activations held to what autograd really saves, for families without rules.

Ground truth is measured as in test_groundtruth_hf.py: ``saved_tensors_hooks`` over a real CPU
forward (distinct storages, parameters excluded). Tiny configs (hidden 64, 2-5 blocks, B=2, S=32).
"""

from __future__ import annotations

import json
from fractions import Fraction

import pytest

from trainmem.estimate.traced import poly as P


# -- exact fitting (no torch) -------------------------------------------------------------------
def test_fit_is_exact_and_rendered_as_dims():
    points = P.grid_points((8, 16, 24))  # B in {2, 3}
    f = lambda B, S: 3 * B * S * S + 5 * S + 2 * B + 7  # noqa: E731
    c = P.fit(points, [f(b, s) for b, s in points])
    assert c == (7, 2, 5, 0, 0, 3)  # 1, B, S, B·S, S², B·S²
    assert P.value(c, 4, 40) == f(4, 40) == 19415  # 3·4·1600 + 200 + 8 + 7
    assert P.render(c) == "3·B·S·S+5·S+2·B+7"
    from trainmem.estimate.symbols import evaluate
    assert evaluate(P.render(c), {"B": 4, "S": 40}) == 19415


def test_fit_keeps_fractions_and_one_batch_size():
    points = P.grid_points((8, 16, 24), (1,))
    c = P.fit(points, [s // 2 + 1 for _, s in points])  # S/2 + 1 at B = 1
    assert c == (1, 0, Fraction(1, 2), 0, 0, 0)
    assert P.render(c) == "S/2+1"
    assert P.from_json(P.to_json(c)) == c


def test_fit_refuses_points_off_the_grid():
    with pytest.raises(ValueError):
        P.fit(((1, 8), (2, 9)), [1, 2])


torch = pytest.importorskip("torch")

from trainmem.errors import SpecError, UnsupportedError  # noqa: E402
from trainmem.estimate import estimate  # noqa: E402
from trainmem.models.hf import build_hf_model  # noqa: E402
from trainmem.specs import ImplSpec, StepSpec  # noqa: E402
from trainmem.specs.loaders import SUPPORTED_MODEL_TYPES, load_model  # noqa: E402
from trainmem.trace.saved import saved_tensors  # noqa: E402

B, S = 2, 32
SMALL = dict(hidden_size=64, intermediate_size=176, num_hidden_layers=3, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=500)
RULED = {  # families with hand-written hf rules
    "llama": dict(model_type="llama", **SMALL),
    "qwen2": dict(model_type="qwen2", **SMALL),
    "mistral": dict(model_type="mistral", **SMALL),
    # S=32 past a 16-token window: fitted at S = 24, 32, 40 (held out 56), the regime past the window
    "mistral_swa": dict(model_type="mistral", **SMALL, sliding_window=16),
    "gpt2": dict(model_type="gpt2", n_embd=64, n_layer=3, n_head=4, vocab_size=500, n_positions=128,
                 attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0),
}
UNRULED = {  # no hand-written rules: only the trace knows them
    "olmo2": dict(model_type="olmo2", **SMALL),
    "granite": dict(model_type="granite", **SMALL),
    "cohere": dict(model_type="cohere", **SMALL),
    "starcoder2": dict(model_type="starcoder2", **SMALL),
    "qwen3_moe": dict(model_type="qwen3_moe", **{**SMALL, "moe_intermediate_size": 32}, num_experts=4,
                      num_experts_per_tok=2, head_dim=16),
    "phi": dict(model_type="phi", **{k: v for k, v in SMALL.items() if k != "num_key_value_heads"}, resid_pdrop=0.0,
                embd_pdrop=0.0),
    "falcon": dict(model_type="falcon", hidden_size=64, num_hidden_layers=3, num_attention_heads=4, vocab_size=500),
    "roberta": dict(model_type="roberta", **{k: v for k, v in SMALL.items() if k != "num_key_value_heads"},
                    max_position_embeddings=80, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0),  # MLM
    # layer kinds: dense blocks 0 and 3 (mlp_only_layers), MoE blocks 1, 2, 4, the last block 5
    "qwen3_moe_mixed": dict(model_type="qwen3_moe", **{**SMALL, "moe_intermediate_size": 32, "num_hidden_layers": 6},
                            num_experts=4, num_experts_per_tok=2, head_dim=16, mlp_only_layers=[0, 3]),
    # layer kinds: five local (sliding) blocks, a global one, and the last block; 9 blocks, 8 traced
    "gemma3_text": dict(model_type="gemma3_text", **{**SMALL, "num_hidden_layers": 9}, head_dim=16,
                        sliding_window=16),
}


# gemma3_text has hand-written rules too (layer kinds): the two must agree
RULED["gemma3_text"] = UNRULED["gemma3_text"]


pytestmark = pytest.mark.usefixtures("traced_cache")  # one TRAINMEM_CACHE per session: tests/conftest.py


def _model(tmp_path, cfg):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    return load_model(str(path)) if cfg["model_type"] in SUPPORTED_MODEL_TYPES else _generic(str(path))


def _generic(path):
    from trainmem.estimate.traced import unmapped_model_spec
    return unmapped_model_spec(path)


def _activations(e) -> int:
    return e.totals_bytes["activation"]


def _compare_with_hf(tmp_path, family, precision, attention):
    model = _model(tmp_path, RULED[family])
    step = StepSpec(batch=B, seq=S, precision=precision)
    traced = estimate(model, step, ImplSpec(profile="traced", device="cpu", attention=attention))
    ruled = estimate(model, step, ImplSpec(profile="hf", device="cpu", attention=attention))
    assert _activations(traced) == _activations(ruled)
    assert traced.totals_bytes == ruled.totals_bytes  # parameters, gradients, states from the meta model
    assert traced.peak_bytes == ruled.peak_bytes


@pytest.mark.slow  # ~10 s alone, most of it transformers' first model build and fake-tensor warm-up
def test_traced_equals_hf_rules_llama_bf16_sdpa(tmp_path):
    _compare_with_hf(tmp_path, "llama", "bf16", "sdpa")


@pytest.mark.slow
@pytest.mark.parametrize("family", list(RULED))
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("attention", ["eager", "sdpa"])
def test_traced_equals_hf_rules(tmp_path, family, precision, attention):
    _compare_with_hf(tmp_path, family, precision, attention)


def _measured(cfg, precision, attention, batch=B, routing="balanced"):
    """What autograd saves in a real CPU forward (MoE routing forced as the trace forces it)."""
    import contextlib

    from trainmem.specs.impl import routing_hot_fraction
    from trainmem.trace.routing import experts_modules, force_routing

    from trainmem.trace.torch_state import default_dtype

    torch.manual_seed(0)
    with default_dtype(torch.bfloat16 if precision == "bf16" else torch.float32):  # as trace_step builds it
        model = build_hf_model(cfg, attention=attention)
    ids = torch.randint(0, cfg["vocab_size"], (batch, S))
    ctx = force_routing(model, routing_hot_fraction(routing)) if experts_modules(model) else contextlib.nullcontext()
    with ctx:
        # Gemma-3's embed_scale, a buffer autograd saves, is the buffer item, not an activation
        saved, loss = saved_tensors(model, lambda: model(ids, labels=ids).loss, buffers=False)
    return sum(s.nbytes for s in saved) + loss.untyped_storage().nbytes()  # the loss the caller holds: loss.value


@pytest.mark.slow
@pytest.mark.parametrize("family", list(UNRULED))
@pytest.mark.parametrize("attention", ["eager", "sdpa"])
def test_traced_equals_autograd_without_rules(tmp_path, family, attention):
    cfg = UNRULED[family]
    model = _model(tmp_path, cfg)
    e = estimate(model, StepSpec(batch=B, seq=S, precision="bf16"),
                 ImplSpec(profile="traced", device="cpu", attention=attention, routing="balanced"))
    assert _activations(e) == _measured(cfg, "bf16", attention)


@pytest.mark.slow
def test_batch_one_is_its_own_fit(tmp_path):
    # at B = 1 PyTorch skips copies of already-contiguous views (q after RoPE, the shifted labels),
    # so other tensors are saved: the B = 1 template is fitted at B = 1 and held to autograd
    cfg = RULED["llama"]
    e = estimate(_model(tmp_path, cfg), StepSpec(batch=1, seq=S, precision="fp32"),
                 ImplSpec(profile="traced", device="cpu", attention="eager"))
    assert _activations(e) == _measured(cfg, "fp32", "eager", batch=1)


def _retained(cfg, impl):
    """Under checkpointing: bytes made in a real forward and still alive after it (hooks cannot see
    inside checkpoint regions), as test_groundtruth_hf.py measures, with the ids and the loss (loss.value)."""
    import contextlib

    from trainmem.trace.recompute import enable_recompute, selective_recompute
    from trainmem.trace.torch_state import default_dtype
    from trainmem.trace.saved import retained_bytes

    torch.manual_seed(0)
    with default_dtype(torch.bfloat16):
        model = build_hf_model(cfg, attention=impl.attention)
    model.train()
    enable_recompute(model, impl)
    ids = torch.randint(0, cfg["vocab_size"], (B, S))
    core = selective_recompute(model, impl.attention) if impl.recompute == "selective" else contextlib.nullcontext()
    with core:
        kept, loss = retained_bytes(model, lambda: model(ids, labels=ids).loss)
    assert loss.untyped_storage().nbytes() == 4  # the fp32 loss the caller holds, counted in kept
    return kept + ids.untyped_storage().nbytes()


@pytest.mark.slow
@pytest.mark.parametrize("recompute", ["full", "selective", "op", "every-k"])
def test_traced_recompute_equals_what_is_retained(tmp_path, recompute):
    # on fake tensors transformers would materialize the causal mask without a KV cache
    # (trace/hf_masks.py): full, op and every-k were 2-26 KiB over before that
    cfg = {**RULED["llama"], "num_hidden_layers": 5}
    impl = ImplSpec(profile="traced", device="cpu", attention="sdpa", recompute=recompute,
                    recompute_every=2 if recompute == "every-k" else 1)
    e = estimate(_model(tmp_path, cfg), StepSpec(batch=B, seq=S, precision="bf16"), impl)
    assert _activations(e) == _retained(cfg, impl)


@pytest.mark.slow
def test_layer_kinds_and_tp_plan(tmp_path):
    from trainmem.estimate.traced import traced_template
    cfg = UNRULED["gemma3_text"]
    step, impl = StepSpec(batch=B, seq=S, precision="bf16"), ImplSpec(profile="traced", device="cpu")
    tpl = traced_template(cfg, step, impl)
    # layer_types: every 6th block global (index 5); the last block (8) is its own template
    assert [k.layers for k in tpl.kinds] == [(0, 1, 2, 3, 4, 6, 7), (5,), (8,)]
    assert tpl.traced_layers == 8
    assert tpl.num_parameters() == sum(p.numel() for p in build_hf_model(cfg).parameters())
    assert tpl.tp_plan["model.layers.*.self_attn.q_proj"] == "colwise"  # transformers' base_model_tp_plan


def test_refusals_name_the_field(tmp_path):
    model = _model(tmp_path, RULED["llama"])
    with pytest.raises(SpecError, match="device='cuda'"):
        estimate(model, StepSpec(batch=B, seq=S), ImplSpec(profile="traced"))
    from trainmem.specs import ModelSpec
    custom = ModelSpec(hidden_size=64, num_layers=2, num_heads=4, ffn_size=128, vocab_size=100)
    with pytest.raises(SpecError, match="model='custom'"):
        estimate(custom, StepSpec(batch=B, seq=S), ImplSpec(profile="traced", device="cpu"))
