"""The family registry (issue 16 part 2): a family is defined once, and everything asks the registry."""

from __future__ import annotations

import re
from dataclasses import replace
from pathlib import Path

import pytest

from trainmem import families as F
from trainmem.errors import SpecError
from trainmem.estimate.params import parameter_shapes
from trainmem.families import base
from trainmem.names import as_block, is_embedding, is_head, is_token_embedding, layer_index, layer_of, split_block
from trainmem.specs import ModelSpec
from trainmem.specs.loaders import SUPPORTED_MODEL_TYPES, load_model, spec_from_hf_config
from trainmem.specs.presets import estimated_presets

SRC = Path(__file__).resolve().parents[2] / "src" / "trainmem"


@pytest.fixture
def scratch_registry(monkeypatch):
    """Registrations inside a test are forgotten after it."""
    monkeypatch.setattr(base, "_FAMILIES", dict(base._FAMILIES))
    monkeypatch.setattr(base, "_SCHEMES", dict(base._SCHEMES))
    yield
    monkeypatch.undo()
    base._clear()


def test_a_family_registered_twice_is_refused(scratch_registry):
    before = F.family_names()
    with pytest.raises(SpecError, match="family='llama'.*already registered"):
        F.register_family(lambda: F.get_family("llama"))
    with pytest.raises(SpecError, match="scheme='reference'.*already registered"):
        F.register_scheme(lambda: base._SCHEMES["reference"])
    with pytest.raises(SpecError, match="already registered"):  # a scheme may not take a family's name
        F.register_scheme(lambda: F.NameScheme(name="gpt2", embeddings=(), head=(), layers="x"))
    assert F.family_names() == before


def test_an_unknown_family_names_the_known_ones():
    with pytest.raises(SpecError, match=r"family='gpt5': must be one of gpt2, gpt_neox, llama"):
        F.get_family("gpt5")
    with pytest.raises(SpecError, match="family='gpt5'"):
        ModelSpec(family="gpt5", hidden_size=64, num_layers=2, num_heads=4, ffn_size=128, vocab_size=100)


@pytest.mark.parametrize("preset", estimated_presets())  # the presets the estimator maps
def test_every_preset_resolves_through_the_registry(preset):
    m = load_model(preset)
    fam = F.family_of(m)
    assert fam.name == m.family and fam.config is not None
    names = [n for n, _ in parameter_shapes(m)]
    assert names[0].rpartition(".")[0] == fam.embeddings[0]  # the token embedding comes first
    assert is_token_embedding(names[0]) and is_embedding(names[0])
    block = [n for n in names if layer_index(n) is not None]
    assert len(block) > 0 and all(n.startswith(fam.layers + ".") for n in block)
    assert {layer_index(n) for n in block} == set(range(m.num_layers))
    outside = [n for n in names if layer_index(n) is None]
    assert all(is_embedding(n) != is_head(n) or n.startswith("bert.embeddings.LayerNorm") for n in outside), outside
    assert any(is_head(n) for n in outside)  # a final norm or an output layer


def test_the_config_readers_are_the_registry():
    assert SUPPORTED_MODEL_TYPES == tuple(F.config_families())
    for t, fam in F.config_families().items():
        sizes = {k: fam.config.defaults[k] for k in fam.config.required}
        m = spec_from_hf_config({"model_type": t, **sizes}, name=t)
        assert m.family == t
        assert fam.layer_kinds is None  # the hook is there; no family uses it yet


def test_adding_a_family_touches_one_place(scratch_registry):
    """A new family, registered from one place, is read from a config, validated, laid out and
    named without touching anything else."""
    llama = F.get_family("llama")

    def toy() -> F.Family:
        return replace(llama, name="toy", layers="model.blocks", config=replace(
            llama.config, config_class="ToyConfig", fixed={"qk_norm": True}),
            parameters=lambda m: [(n.replace("model.layers.", "model.blocks."), s) for n, s in llama.parameters(m)])

    F.register_family(toy)
    sizes = dict(vocab_size=128, hidden_size=64, num_hidden_layers=3, num_attention_heads=4, intermediate_size=96)
    m = spec_from_hf_config({"model_type": "toy", **sizes}, name="toy")
    assert (m.family, m.qk_norm) == ("toy", True)
    names = [n for n, _ in parameter_shapes(m)]
    assert "model.blocks.2.self_attn.q_norm.weight" in names
    assert layer_index("model.blocks.2.self_attn.q_norm.weight") == 2  # the container is known at once
    assert "blocks" in F.layer_containers()


def test_name_helpers_are_exact():
    assert layer_of("model.layers.3.mlp.up_proj.out") == 3
    assert layer_of("model.layers.3") is None  # an item named 3 in model.layers: not a block's
    assert layer_index("model.layers.3") == 3
    assert layer_of("layers.0.attn.q_rope") == 0  # reference names have no root module
    assert layer_of("bert.encoder.layer.11.output.dense.weight") == 11
    assert split_block("transformer.h.2.attn.c_attn.weight.exp_avg") == ("transformer.h.", 2, "attn.c_attn.weight.exp_avg")
    assert split_block("model.norm.weight") is None
    assert as_block("model.layers.17.mlp.down_proj.weight") == "model.layers.0.mlp.down_proj.weight"
    assert as_block("layers.5.attn.q", 2) == "layers.2.attn.q"
    assert is_head("loss.log_softmax") and is_head("norm.out") and is_head("final_layernorm.out")
    assert is_head("cls.predictions.transform.dense.weight") and not is_head("model.layers.0.mlp.out")
    assert not is_head("normed")  # a module path, not a string prefix
    assert is_embedding("transformer.wpe.weight") and not is_token_embedding("transformer.wpe.weight")


def test_tp_roles_cover_every_block_linear_of_every_family():
    roles = F.tp_roles()
    for fam in F.families():
        for name in fam.tp.column + fam.tp.row:
            assert name in roles.column + roles.row
    # a 2-D weight inside a block of a preset is column- or row-parallel (or an MoE router/expert)
    from trainmem.estimate.parallel_tp import _tp_factor
    for preset in ("llama-3-8b", "gpt2", "phi-3-mini", "bert-large", "qwen2.5-7b", "gemma-2-9b"):
        for n, shape in parameter_shapes(replace(load_model(preset), num_layers=1)):
            if layer_index(n) is not None and len(shape) == 2:
                assert _tp_factor(n, tp=2, ep=1) == 2, (preset, n)


_FAMILY_TEST = re.compile(r"\bfamily\s*(?:==|!=|\bin\s*\(|\bnot\s+in\s*\()")


def test_no_family_string_comparisons_outside_the_registry():
    """Family knowledge lives in trainmem/families/: no `family == "..."` branches elsewhere."""
    offenders = []
    for path in SRC.rglob("*.py"):
        if "families" in path.relative_to(SRC).parts:
            continue
        for i, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if _FAMILY_TEST.search(line):
                offenders.append(f"{path.relative_to(SRC)}:{i}: {line.strip()}")
    assert offenders == []


@pytest.mark.parametrize("kw", [
    {},  # Llama-like: gated MLP, RMSNorm, rotary, untied
    dict(family="gpt2", activation="gelu_tanh", norm="layernorm", norm_bias=True, qkv_bias=True, out_bias=True,
         mlp_bias=True, tied_embeddings=True, max_positions=32),
    dict(family="qwen2", qkv_bias=True, num_kv_heads=2),
])
def test_reference_parameters_are_the_reference_models(kw):
    """Under --profile reference the parameters are the reference model's own, by name and shape,
    so they share one naming scheme with its activations (layers.0.attn.q ...)."""
    torch = pytest.importorskip("torch")
    from trainmem.models.reference import build_reference_model
    from trainmem.specs import ImplSpec

    m = ModelSpec(**{"hidden_size": 64, "num_layers": 2, "num_heads": 4, "ffn_size": 96, "vocab_size": 100, **kw})
    real = [(n, tuple(p.shape)) for n, p in build_reference_model(m, ImplSpec(profile="reference"),
                                                                   dtype=torch.float32).named_parameters()]
    assert parameter_shapes(m, "reference") == real
    assert all(layer_index(n) is not None or is_embedding(n) or is_head(n) for n, _ in real)
