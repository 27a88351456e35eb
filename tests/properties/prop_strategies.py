"""Hypothesis strategies for valid specs, and an ``est`` that skips what the estimator refuses."""

from __future__ import annotations

from hypothesis import assume, strategies as st

from trainmem.errors import SpecError, UnsupportedError
from trainmem.estimate import estimate
from trainmem.specs import ImplSpec, ModelSpec, ParallelSpec, StepSpec
from trainmem.specs.impl import ATTENTIONS, PROFILES
from trainmem.specs.step import LOSSES, OPTIMIZERS, PRECISIONS

DECODER_FAMILIES = ("gpt2", "gpt_neox", "llama", "mistral", "mixtral", "qwen2", "qwen3",
                    "gemma", "gemma2", "phi3", "generic")
MOE_FAMILIES = ("llama", "mistral", "mixtral", "qwen2", "qwen3", "generic")


@st.composite
def models(draw, *, moe: bool = True, layers=st.integers(1, 4)) -> ModelSpec:
    """A small Transformer with consistent heads, kv heads, head_dim and FFN."""
    kv = draw(st.sampled_from((1, 2, 4)))
    heads = kv * draw(st.sampled_from((1, 2, 4)))
    head_dim = draw(st.sampled_from((8, 16)))
    explicit_hd = draw(st.booleans())
    hidden = heads * head_dim * (draw(st.sampled_from((1, 2))) if explicit_hd else 1)
    family = draw(st.sampled_from(DECODER_FAMILIES + ("bert",)))
    arch = "encoder" if family == "bert" else "decoder"
    activation = draw(st.sampled_from(("gelu", "gelu_tanh", "relu", "swiglu", "geglu")))
    experts = 0
    if moe and family in MOE_FAMILIES and draw(st.booleans()):
        experts = draw(st.sampled_from((2, 4)))
    return ModelSpec(
        family=family, arch=arch, hidden_size=hidden, num_layers=draw(layers), num_heads=heads,
        num_kv_heads=kv, head_dim=head_dim if explicit_hd else None,
        ffn_size=draw(st.integers(1, 24)) * 8, activation=activation,
        norm=draw(st.sampled_from(("layernorm", "rmsnorm"))),
        qkv_bias=draw(st.booleans()), mlp_bias=draw(st.booleans()), out_bias=draw(st.booleans()),
        tied_embeddings=draw(st.booleans()), vocab_size=draw(st.integers(8, 300)),
        attn_dropout=draw(st.sampled_from((0.0, 0.1))), hidden_dropout=draw(st.sampled_from((0.0, 0.1))),
        num_experts=experts, top_k=draw(st.integers(1, experts)) if experts else 0,
    )


@st.composite
def steps(draw, *, seq=st.integers(1, 48).map(lambda k: 32 * k)) -> StepSpec:
    return StepSpec(batch=draw(st.integers(1, 4)), seq=draw(seq), grad_accum=draw(st.sampled_from((1, 4))),
                    precision=draw(st.sampled_from(PRECISIONS)), optimizer=draw(st.sampled_from(OPTIMIZERS)),
                    loss=draw(st.sampled_from(LOSSES)))


@st.composite
def impls(draw, *, attention=st.sampled_from(ATTENTIONS), recompute=None) -> ImplSpec:
    profile = draw(st.sampled_from(PROFILES))
    rc = draw(recompute if recompute is not None else st.sampled_from(("none", "selective", "full", "every-k")))
    ref = profile == "reference"
    return ImplSpec(profile=profile, attention=draw(attention), recompute=rc,
                    recompute_every=draw(st.integers(1, 3)) if rc == "every-k" else 1,
                    fused_norm=ref and draw(st.booleans()), fused_bias_act=ref and draw(st.booleans()),
                    fused_dropout=ref and draw(st.booleans()), inplace_act=ref and draw(st.booleans()),
                    device=draw(st.sampled_from(("cuda", "cpu"))))


def est(model: ModelSpec, step: StepSpec, impl: ImplSpec, parallel: ParallelSpec | None = None):
    """The estimate, or a hypothesis ``assume`` failure for combinations trainmem refuses."""
    try:
        return estimate(model, step, impl, parallel)
    except (SpecError, UnsupportedError):
        assume(False)


def ledgers(e) -> dict[str, int]:
    return e.totals_bytes


def model_states(totals: dict[str, int]) -> int:
    return sum(totals.get(k, 0) for k in ("parameter", "gradient", "master_weight", "optimizer_state"))
