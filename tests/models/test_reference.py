"""The reference model: names, refusals, and that every memory knob leaves the numbers alone."""

from __future__ import annotations

import contextlib

import pytest

torch = pytest.importorskip("torch")

from trainmem.errors import UnsupportedError  # noqa: E402
from trainmem.models.reference import build_reference_model  # noqa: E402
from trainmem.specs import ImplSpec, ModelSpec  # noqa: E402

BASE = dict(hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, ffn_size=48, vocab_size=97)


def _impl(**kw) -> ImplSpec:
    return ImplSpec(profile="reference", device="cpu", **kw)


def _loss_and_grads(model: ModelSpec, impl: ImplSpec, *, amp: bool = False):
    torch.manual_seed(0)
    net = build_reference_model(model, impl)
    ids = torch.randint(0, model.vocab_size, (2, 16))
    with torch.autocast("cpu", dtype=torch.bfloat16) if amp else contextlib.nullcontext():
        out = net(ids, labels=ids)
    out.loss.backward()
    return out.loss.detach(), {n: p.grad.clone() for n, p in net.named_parameters()}


def test_module_names_follow_the_estimate_items():
    net = build_reference_model(ModelSpec(**BASE, activation="swiglu"), _impl())
    names = {n for n, _ in net.named_modules()}
    for n in ("embed", "layers.0.attn_norm", "layers.0.attn.q", "layers.0.attn.k", "layers.0.attn.v",
              "layers.0.attn.o", "layers.1.mlp_norm", "layers.1.mlp.gate", "layers.1.mlp.up",
              "layers.1.mlp.down", "norm", "lm_head"):
        assert n in names, n


def test_loss_is_fp32_cross_entropy_of_shifted_labels():
    net = build_reference_model(ModelSpec(**BASE), _impl())
    ids = torch.randint(0, 97, (2, 16))
    out = net(ids, labels=ids)
    expect = torch.nn.functional.cross_entropy(out.logits[:, :-1].reshape(-1, 97).float(), ids[:, 1:].reshape(-1))
    assert out.loss.dtype == torch.float32
    torch.testing.assert_close(out.loss, expect)


def test_tied_embeddings_share_one_parameter():
    net = build_reference_model(ModelSpec(**BASE, tied_embeddings=True), _impl())
    assert net.lm_head.weight is net.embed.weight


@pytest.mark.parametrize("model_kw, impl_kw, match", [
    (dict(num_experts=4, top_k=2), {}, "MoE not implemented"),
    (dict(qk_norm=True), {}, "QK-norm"),
    ({}, dict(attention="mem-efficient"), "no CPU kernel"),
    (dict(attn_dropout=0.1), dict(attention="flash"), "no dropout"),
])
def test_refuses_what_it_does_not_implement(model_kw, impl_kw, match):
    with pytest.raises(UnsupportedError, match=match):
        build_reference_model(ModelSpec(**BASE, **model_kw), _impl(**impl_kw))


MODELS = {
    "swiglu-rms": dict(activation="swiglu"),
    "gelu-ln-bias": dict(activation="gelu", norm="layernorm", norm_bias=True, mlp_bias=True, max_positions=32),
    "relu-ln": dict(activation="relu", norm="layernorm", mlp_bias=True),
    "geglu": dict(activation="geglu"),
    "gelu-tanh-parallel": dict(activation="gelu_tanh", parallel_residual=True),
}
KNOBS = [dict(attention=a) for a in ("eager", "flash", "sdpa-math")] + [
    dict(fused_norm=True), dict(fused_bias_act=True), dict(inplace_act=True),
    dict(recompute="selective"), dict(recompute="full"), dict(recompute="every-k", recompute_every=2),
]


@pytest.mark.parametrize("knob", KNOBS, ids=lambda k: ",".join(f"{a}={b}" for a, b in k.items()))
@pytest.mark.parametrize("family", list(MODELS))
def test_knobs_change_memory_not_numbers(family, knob):
    """Same weights, same loss and gradients: a kernel or recompute choice is not a model change."""
    model = ModelSpec(**BASE, **MODELS[family])
    loss0, grads0 = _loss_and_grads(model, _impl())
    loss1, grads1 = _loss_and_grads(model, _impl(**knob))
    torch.testing.assert_close(loss1, loss0, rtol=1e-5, atol=1e-5)
    for n, g in grads0.items():
        torch.testing.assert_close(grads1[n], g, rtol=1e-4, atol=1e-5, msg=lambda m, n=n: f"{n}: {m}")


def test_packed_bit_dropout_keeps_one_bit_per_element():
    from trainmem.trace.saved import saved_tensors

    model = ModelSpec(**BASE, hidden_dropout=0.5)
    net = build_reference_model(model, _impl(fused_dropout=True))
    ids = torch.randint(0, 97, (2, 16))
    saved, loss = saved_tensors(net, lambda: net(ids, labels=ids).loss)
    loss.backward()
    masks = [s for s in saved if s.dtype == "uint8"]
    assert len(masks) == 2 * 2  # two residual branches x two layers
    assert {s.nbytes for s in masks} == {2 * 16 * 32 // 8}  # B·S·H/8 = 128


def test_amp_runs_every_attention():
    model = ModelSpec(**BASE, activation="gelu", norm="layernorm")
    losses = [_loss_and_grads(model, _impl(attention=a), amp=True)[0] for a in ("eager", "sdpa", "sdpa-math")]
    for loss in losses[1:]:
        torch.testing.assert_close(loss, losses[0], rtol=2e-2, atol=2e-2)
