"""The ``reference`` profile against what autograd really keeps in the reference model (CPU).

Without checkpointing the measurement is saved-tensor hooks (distinct storages, parameters
excluded), and live-storage tracking must agree with it. With checkpointing hooks cannot see
inside the regions, so the measurement is the retained bytes + the input ids (created outside
the call) - the 4-byte loss (returned, not kept for backward). Tolerance 2% (all exact today).
"""

from __future__ import annotations

import contextlib
from collections import Counter

import pytest

torch = pytest.importorskip("torch")

from trainmem.estimate.activations import activation_items  # noqa: E402
from trainmem.models.reference import build_reference_model  # noqa: E402
from trainmem.specs import ImplSpec, ModelSpec, StepSpec  # noqa: E402
from trainmem.trace.saved import retained_bytes, saved_tensors  # noqa: E402

TOL = 0.02
DTYPES = {"fp32": None, "bf16": torch.bfloat16, "amp-bf16": None}
BASE = dict(hidden_size=64, num_layers=2, num_heads=4, ffn_size=96, vocab_size=500)


def _spec(**kw) -> ModelSpec:
    return ModelSpec(**{**BASE, **kw})


def _measure(model: ModelSpec, impl: ImplSpec, precision: str, B: int, S: int):
    torch.manual_seed(0)
    net = build_reference_model(model, impl, dtype=DTYPES[precision])
    ids = torch.randint(0, model.vocab_size, (B, S))
    amp = precision.startswith("amp")

    def fn():
        with torch.autocast("cpu", dtype=torch.bfloat16) if amp else contextlib.nullcontext():
            return net(ids, labels=ids).loss

    saved, _ = saved_tensors(net, fn)
    retained, loss = retained_bytes(net, fn)
    loss.backward()  # the model really trains under this configuration
    # with the loss the caller holds (not saved): the estimate's loss.value
    return saved, retained + ids.numel() * ids.element_size(), loss.numel() * loss.element_size()


def _diff(items, saved) -> str:
    est = Counter((i.bytes, i.dtype) for i in items)
    got = Counter((s.nbytes, s.dtype) for s in saved)
    lines = []
    for key in sorted((est - got) | (got - est)):
        extra, missing = (est - got)[key], (got - est)[key]
        if extra:
            names = [i.name for i in items if (i.bytes, i.dtype) == key]
            lines.append(f"  estimate only: {extra} x {key}  e.g. {names[:4]}")
        if missing:
            fns = [s.grad_fn for s in saved if (s.nbytes, s.dtype) == key]
            lines.append(f"  measured only: {missing} x {key}  grad_fn {fns[:4]}")
    return "\n".join(lines)


def check(model: ModelSpec, precision: str = "fp32", *, B: int = 2, S: int = 32, **impl_kw) -> None:
    impl = ImplSpec(profile="reference", device="cpu", **impl_kw)
    items = activation_items(model, StepSpec(batch=B, seq=S, precision=precision), impl)
    estimate = sum(i.bytes for i in items)
    saved, retained, held = _measure(model, impl, precision, B, S)
    hooks = sum(s.nbytes for s in saved) + held
    checkpointed = impl.recompute != "none"
    measured = retained if checkpointed else hooks
    ctx = f"{precision} {impl_kw} {model.activation}/{model.norm}: estimate {estimate} measured {measured}"
    if not checkpointed:
        assert retained == hooks, f"{ctx}: retained {retained} != hooks {hooks}"
        assert abs(estimate - measured) <= TOL * measured, f"{ctx}\n{_diff(items, saved)}"
    else:
        names = "\n".join(f"  {i.name} {i.dtype} {i.bytes}" for i in items)
        assert abs(estimate - measured) <= TOL * measured, f"{ctx}\nestimate items:\n{names}"


ATTENTIONS = ["eager", "sdpa", "flash", "sdpa-math"]
PRECISIONS = ["fp32", "bf16", "amp-bf16"]


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("attention", ATTENTIONS)
def test_attention_precision(attention, precision):
    check(_spec(num_kv_heads=2), precision, attention=attention)


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("attention", ["eager", "sdpa", "sdpa-math"])
def test_dropout(attention, precision):
    check(_spec(attn_dropout=0.1, hidden_dropout=0.1, embd_dropout=0.1), precision, attention=attention)


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("recompute", ["selective", "full", "every-k"])
@pytest.mark.parametrize("attention", ["eager", "sdpa"])
def test_recompute(attention, recompute, precision):
    every = {"recompute_every": 2} if recompute == "every-k" else {}
    check(_spec(num_layers=3, hidden_dropout=0.1), precision, attention=attention, recompute=recompute, **every)


FUSIONS = {
    "fused_norm": dict(fused_norm=True),
    "fused_bias_act": dict(fused_bias_act=True),
    "fused_dropout": dict(fused_dropout=True),
    "inplace_act": dict(inplace_act=True),
    "all": dict(fused_norm=True, fused_bias_act=True, fused_dropout=True, inplace_act=True),
}
MODELS = {
    "llama": dict(),
    "gpt": dict(norm="layernorm", norm_bias=True, activation="gelu", mlp_bias=True, qkv_bias=True,
                out_bias=True, max_positions=64, tied_embeddings=True),
    "relu-parallel": dict(norm="layernorm", activation="relu", parallel_residual=True, mlp_bias=True),
    "geglu-tanh": dict(activation="geglu", head_dim=8),
    "gelu-tanh": dict(activation="gelu_tanh", norm="layernorm"),
}


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("fusion", list(FUSIONS))
@pytest.mark.parametrize("family", list(MODELS))
def test_fusions(family, fusion, precision):
    m = _spec(**MODELS[family], attn_dropout=0.1, hidden_dropout=0.1)
    check(m, precision, attention="eager", **FUSIONS[fusion])


def test_longer_sequence_and_batch():
    check(_spec(num_kv_heads=1, num_layers=3), "bf16", B=3, S=64, attention="eager")
