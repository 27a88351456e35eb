"""Layer kinds (issue 14 item 4): each family's config reader gives every block its kind, the
parameter layout equals the real transformers model built on the meta device (tiny configs and
full-size ones), and the estimator keeps one template per kind; Gemma-3's local/global blocks
equal autograd's saved set to the byte (CPU)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from trainmem.errors import SpecError, UnsupportedError
from trainmem.estimate.activations import activation_inventory, activation_items
from trainmem.estimate.params import parameter_shapes
from trainmem.specs import ImplSpec, ModelSpec, StepSpec
from trainmem.specs.layer_kind import LayerKind, fit_kinds
from trainmem.specs.loaders import list_presets, load_config_dict, spec_from_hf_config

from kinds_configs import CONFIGS, KINDS, check_against_autograd

_NOT_CONFIG = ("model_type", "_source", "source", "architectures", "auto_map", "transformers_version", "torch_dtype",
               "dtype")


def _meta_parameters(cfg: dict) -> list[tuple[str, tuple[int, ...]]]:
    from transformers import AutoConfig, AutoModelForCausalLM
    hf = AutoConfig.for_model(cfg["model_type"], **{k: v for k, v in cfg.items() if k not in _NOT_CONFIG})
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf)
    return [(n, tuple(p.shape)) for n, p in model.named_parameters()]


@pytest.mark.parametrize("family", sorted(CONFIGS))
def test_tiny_kinds_and_parameters_equal_the_real_model(family):
    cfg = CONFIGS[family]
    spec = spec_from_hf_config(cfg)
    assert [k.label for k in spec.kinds] == KINDS[family]
    assert parameter_shapes(spec) == _meta_parameters(cfg)


def _full_size():
    """The config classes' own defaults (the full-size models) and the shipped presets of these families."""
    cases = [(f"{f} defaults", {"model_type": f, **({"num_experts_per_tok": 6} if f == "deepseek_v2" else {})})
             for f in sorted(CONFIGS)]
    families = set(CONFIGS)
    for name in list_presets():
        if load_config_dict(name)["model_type"] in families:
            cases.append((name, None))
    return cases


@pytest.mark.slow
@pytest.mark.parametrize("name,cfg", _full_size(), ids=[c[0] for c in _full_size()])
def test_full_size_parameters_equal_the_real_model(name, cfg):
    if cfg is None:
        cfg = load_config_dict(name)
    else:  # every key as the config class writes it, as a config.json from the Hub would
        from transformers import AutoConfig
        cfg = {**AutoConfig.for_model(cfg["model_type"], **{k: v for k, v in cfg.items() if k != "model_type"}).to_dict(),
               **cfg}
    assert parameter_shapes(spec_from_hf_config(cfg, name=name)) == _meta_parameters(cfg)


def test_full_size_kind_counts():
    # DeepSeek-V3: 3 dense blocks then 58 MoE; Gemma-3: five local blocks per global one;
    # Llama-4 Scout (the class defaults): every 4th block global NoPE, MoE everywhere
    def counts(model_type):
        spec = spec_from_hf_config({"model_type": model_type})
        return {k.label: n for k, n in ((k, spec.kinds.count(k)) for k in dict.fromkeys(spec.kinds))}
    assert counts("deepseek_v3") == {"full": 3, "full+moe": 58}
    assert counts("gemma3_text") == {"sliding(4096)": 22, "full": 4}
    assert counts("llama4_text") == {"chunked(8192)+moe": 36, "full/nope+moe": 12}
    assert counts("qwen3_next") == {"linear+moe": 36, "full+moe": 12}


def test_mla_head_dims_in_the_spec():
    spec = spec_from_hf_config({"model_type": "deepseek_v3"})
    assert (spec.q_lora_rank, spec.kv_lora_rank, spec.qk_nope_head_dim, spec.qk_rope_head_dim, spec.v_head_dim,
            spec.head_dim) == (1536, 512, 128, 64, 128, 192)


@pytest.mark.parametrize("family", ["qwen3_next"])  # rules_gpt_oss, rules_llama4, rules_mla
def test_hf_profile_refuses_unwritten_kinds_in_one_line(family):
    with pytest.raises(UnsupportedError) as exc:
        activation_items(spec_from_hf_config(CONFIGS[family]), StepSpec(batch=1, seq=16), ImplSpec())
    assert "--profile traced" in str(exc.value) and "\n" not in str(exc.value)


def test_one_template_per_kind():
    # 12 blocks of two kinds: the inventory keeps two simulated templates and repeats them, and
    # expands to exactly the block-by-block simulation
    cfg = {**CONFIGS["gemma3_text"], "num_hidden_layers": 12, "sliding_window_pattern": 3}
    spec, step = spec_from_hf_config(cfg), StepSpec(batch=2, seq=64)
    impl = ImplSpec(attention="sdpa", device="cpu")
    inv = activation_inventory(spec, step, impl)
    # local, local, global, ...: a kind's second block stands for the rest (block 1 for the local
    # blocks, block 5 for the global ones: block 2 keeps the global rotary table)
    assert sorted((r.src, r.dsts) for r in inv.repeats) == [(1, (3, 4, 6, 7, 9, 10)), (5, (8, 11))]
    full = activation_items(spec, step, impl)
    assert sorted((i.name, i.bytes) for i in inv.items) == sorted((i.name, i.bytes) for i in full)


def test_layer_kind_validation():
    with pytest.raises(SpecError, match="window"):
        LayerKind("sliding")
    with pytest.raises(SpecError, match="layer_kinds.attention"):
        LayerKind("local", 16)
    with pytest.raises(SpecError, match="num_experts"):
        ModelSpec(hidden_size=64, num_layers=1, num_heads=4, ffn_size=128, vocab_size=10,
                  layer_kinds=[{"mlp": "moe"}])
    spec = spec_from_hf_config(CONFIGS["gemma3_text"])
    assert ModelSpec(**{**spec.to_dict()}) == spec  # kinds survive to_dict (JSON) and back
    d, m = LayerKind(), LayerKind(mlp="moe")
    assert fit_kinds((d, d, m, m, m, m), 8) == (d, d) + (m,) * 6  # a deeper model repeats the last period
    assert fit_kinds((d, m, d, m), 3) == (d, m, d)


# two cases by default, the rest slow (each builds and runs a model)
GEMMA3_CASES = [(a, p) if (a, p) in (("sdpa", "fp32"), ("eager", "bf16")) else pytest.param(a, p, marks=pytest.mark.slow)
                for a in ("sdpa", "eager") for p in ("fp32", "bf16", "amp-bf16")]


@pytest.mark.parametrize("attention,precision", GEMMA3_CASES)
def test_gemma3_local_and_global_blocks_equal_autograd(attention, precision):
    check_against_autograd(CONFIGS["gemma3_text"], precision, attention)
