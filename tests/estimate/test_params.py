"""parameter_shapes against real Hugging Face models: same names, same shapes, same order."""

from __future__ import annotations

from math import prod

import pytest

from trainmem.errors import UnsupportedError
from trainmem.estimate.params import count_parameters, parameter_shapes
from trainmem.specs.loaders import list_presets, load_config_dict, load_model, spec_from_hf_config
from trainmem.specs.model import ModelSpec

# Tiny configs: a few layers, GQA wherever the family has it, MoE, biases, QK-norm, tied and untied.
_LLAMA_DIMS = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
               "intermediate_size": 48, "vocab_size": 97, "max_position_embeddings": 64}
_MHA_DIMS = {k: v for k, v in _LLAMA_DIMS.items() if k != "num_key_value_heads"}
_SPECIAL = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}  # inside the tiny vocabulary

TINY_CONFIGS = {
    "gpt2-tied": {"model_type": "gpt2", "n_embd": 32, "n_layer": 2, "n_head": 4, "vocab_size": 97,
                  "n_positions": 64, **_SPECIAL},
    "gpt2-untied-relu": {"model_type": "gpt2", "n_embd": 32, "n_layer": 2, "n_head": 4, "vocab_size": 97,
                         "n_positions": 64, "n_inner": 40, "activation_function": "relu",
                         "tie_word_embeddings": False, **_SPECIAL},
    "gpt_bigcode-mqa-untied": {"model_type": "gpt_bigcode", "n_embd": 32, "n_layer": 2, "n_head": 4, "vocab_size": 97,
                               "n_positions": 64, "n_inner": 40, "tie_word_embeddings": False, **_SPECIAL},
    "gpt_bigcode-mha": {"model_type": "gpt_bigcode", "n_embd": 32, "n_layer": 2, "n_head": 4, "vocab_size": 97,
                        "n_positions": 64, "multi_query": False, **_SPECIAL},
    "gpt_neox": {"model_type": "gpt_neox", **_MHA_DIMS, **_SPECIAL},
    "gpt_neox-nobias-tied": {"model_type": "gpt_neox", **_MHA_DIMS, "attention_bias": False,
                             "use_parallel_residual": False, "tie_word_embeddings": True, **_SPECIAL},
    "llama-gqa": {"model_type": "llama", **_LLAMA_DIMS, **_SPECIAL},
    "llama-bias-tied-headdim": {"model_type": "llama", **_LLAMA_DIMS, "head_dim": 16, "attention_bias": True,
                                "mlp_bias": True, "tie_word_embeddings": True, **_SPECIAL},
    "mistral-gqa": {"model_type": "mistral", **_LLAMA_DIMS, **_SPECIAL},
    "mistral-headdim": {"model_type": "mistral", **_LLAMA_DIMS, "head_dim": 4, **_SPECIAL},
    "mixtral-moe": {"model_type": "mixtral", **_LLAMA_DIMS, "num_local_experts": 4,
                    "num_experts_per_tok": 2, **_SPECIAL},
    "qwen2-bias": {"model_type": "qwen2", **_LLAMA_DIMS, **_SPECIAL},
    "qwen2-tied": {"model_type": "qwen2", **_LLAMA_DIMS, "tie_word_embeddings": True, **_SPECIAL},
    "qwen3-qknorm": {"model_type": "qwen3", **_LLAMA_DIMS, "head_dim": 16, **_SPECIAL},
    "qwen3-bias-tied": {"model_type": "qwen3", **_LLAMA_DIMS, "head_dim": 8, "attention_bias": True,
                        "tie_word_embeddings": True, **_SPECIAL},
    "gemma-mqa": {"model_type": "gemma", **_LLAMA_DIMS, "num_key_value_heads": 1, "head_dim": 16, **_SPECIAL},
    "gemma2-tied": {"model_type": "gemma2", **_LLAMA_DIMS, "head_dim": 16, **_SPECIAL},
    "gemma2-untied": {"model_type": "gemma2", **_LLAMA_DIMS, "head_dim": 8, "tie_word_embeddings": False,
                      **_SPECIAL},
    "phi3-gqa": {"model_type": "phi3", **_LLAMA_DIMS, **_SPECIAL},
    "phi3-mha-headdim": {"model_type": "phi3", **_MHA_DIMS, "head_dim": 16, **_SPECIAL},
    "bert-tied": {"model_type": "bert", **_MHA_DIMS, "type_vocab_size": 3, **_SPECIAL},
    "bert-untied": {"model_type": "bert", **_MHA_DIMS, "tie_word_embeddings": False, **_SPECIAL},
    "qwen3_moe-sparse-step": {"model_type": "qwen3_moe", **_LLAMA_DIMS, "head_dim": 8, "num_experts": 4,
                              "num_experts_per_tok": 2, "moe_intermediate_size": 24, "decoder_sparse_step": 2,
                              "mlp_only_layers": [0], **_SPECIAL},
    "olmo2": {"model_type": "olmo2", **_LLAMA_DIMS, **_SPECIAL},
}
# the families whose blocks differ (layer kinds): their tiny configs, with each kind present
from kinds_configs import CONFIGS as _KINDS_CONFIGS  # noqa: E402
TINY_CONFIGS.update({f"{k}-kinds": v for k, v in _KINDS_CONFIGS.items()})

#: Exact ``sum(p.numel() for p in model.parameters())`` of each preset's HF model (transformers 5.x).
PRESET_COUNTS = {
    "gpt2": 124_439_808,
    "gpt2-xl": 1_557_611_200,
    "gpt3-175b": 174_604_259_328,
    "bert-large": 335_174_458,  # BertForMaskedLM: no pooler, MLM transform + output bias
    "llama-2-7b": 6_738_415_616,
    "llama-2-13b": 13_015_864_320,
    "llama-2-70b": 68_976_648_192,
    "llama-3-8b": 8_030_261_248,
    "llama-3-70b": 70_553_706_496,
    "llama-3.1-405b": 405_853_388_800,
    "mistral-7b": 7_241_732_096,
    "mixtral-8x7b": 46_702_792_704,
    "qwen2.5-7b": 7_615_616_512,
    "gemma-2-9b": 9_241_705_984,
    "phi-3-mini": 3_821_079_552,
}

#: Counts as the model cards and papers round them.
PUBLISHED = {
    "llama-2-7b": 6.74e9, "llama-3-8b": 8.03e9, "mixtral-8x7b": 46.7e9, "gpt2": 124e6,
    "bert-large": 335e6, "gpt3-175b": 175e9, "llama-2-70b": 69e9, "llama-3.1-405b": 405e9,
    "gemma-2-9b": 9.24e9, "phi-3-mini": 3.82e9,
}


def _hf_shapes(config: dict, **kwargs) -> list[tuple[str, tuple[int, ...]]]:
    pytest.importorskip("transformers")
    from trainmem.models.hf import build_hf_model

    model = build_hf_model(config, attention="eager", **kwargs)  # Gemma2 has no SDPA path
    return [(name, tuple(p.shape)) for name, p in model.named_parameters()]


# against real models ---------------------------------------------------------------------------------
@pytest.mark.parametrize("key", sorted(TINY_CONFIGS))
def test_shapes_match_hf_model(key):
    config = TINY_CONFIGS[key]
    assert parameter_shapes(spec_from_hf_config(config)) == _hf_shapes(config)


def test_every_supported_model_type_is_exercised():
    from trainmem.specs.loaders import SUPPORTED_MODEL_TYPES

    assert {c["model_type"] for c in TINY_CONFIGS.values()} == set(SUPPORTED_MODEL_TYPES)


@pytest.mark.parametrize("name", sorted(PRESET_COUNTS))
def test_full_size_presets_match_hf_on_meta_device(name):
    # The meta device allocates nothing, so even 405B builds in well under a second.
    torch = pytest.importorskip("torch")
    with torch.device("meta"):
        shapes = _hf_shapes(load_config_dict(name))
    assert parameter_shapes(load_model(name)) == shapes
    assert sum(prod(shape) for _, shape in shapes) == PRESET_COUNTS[name]


# counts ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", sorted(PRESET_COUNTS))
def test_preset_counts_exact(name):
    assert count_parameters(load_model(name)) == PRESET_COUNTS[name]


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_preset_counts_within_half_percent_of_published(name):
    assert count_parameters(load_model(name)) == pytest.approx(PUBLISHED[name], rel=0.005)


def test_gpt2_count_by_hand():
    # wte 50257*768 + wpe 1024*768 + 12 * block + ln_f 2*768, lm_head tied
    # block = ln 2*2*768 + c_attn 768*2304+2304 + c_proj 768*768+768 + c_fc 768*3072+3072 + proj 3072*768+768
    block = 2 * 2 * 768 + (768 * 2304 + 2304) + (768 * 768 + 768) + (768 * 3072 + 3072) + (3072 * 768 + 768)
    assert block == 7_087_872
    assert count_parameters(load_model("gpt2")) == 50257 * 768 + 1024 * 768 + 12 * block + 2 * 768


def test_tiny_generic_exact():
    spec = ModelSpec(hidden_size=8, num_layers=2, num_heads=2, num_kv_heads=1, ffn_size=12, vocab_size=10)
    # head_dim 4: q 8*8 + k 4*8 + v 4*8 + o 8*8 = 192; swiglu 3*12*8 = 288; two RMSNorms 16 -> 496 a layer
    # 2 * 496 + embed 10*8 + final norm 8 + lm_head 10*8 = 1160
    assert count_parameters(spec) == 1160
    names = [n for n, _ in parameter_shapes(spec)]
    assert names[:3] == ["model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight",
                         "model.layers.0.self_attn.k_proj.weight"]
    assert names[-2:] == ["model.norm.weight", "lm_head.weight"]


def test_generic_moe_with_shared_experts():
    spec = ModelSpec(hidden_size=8, num_layers=1, num_heads=2, ffn_size=12, vocab_size=10,
                     num_experts=4, top_k=2, expert_ffn_size=6, num_shared_experts=2, tied_embeddings=True)
    shapes = dict(parameter_shapes(spec))
    assert shapes["model.layers.0.mlp.gate.weight"] == (4, 8)
    assert shapes["model.layers.0.mlp.experts.gate_up_proj"] == (4, 12, 8)  # 2 * expert_ffn_size
    assert shapes["model.layers.0.mlp.experts.down_proj"] == (4, 8, 6)
    assert shapes["model.layers.0.mlp.shared_experts.up_proj.weight"] == (12, 8)  # 2 shared * 6
    # attn 4*8*8 = 256; router 32 + experts 4*12*8 + 4*8*6 = 608; shared 3*12*8 = 288; norms 16
    # 256 + 608 + 288 + 16 + embed 80 + final norm 8 = 1256
    assert count_parameters(spec) == 1256


def test_generic_layernorm_plain_mlp_and_learned_positions():
    spec = ModelSpec(hidden_size=8, num_layers=1, num_heads=2, ffn_size=16, vocab_size=10, activation="gelu",
                     norm="layernorm", norm_bias=True, mlp_bias=True, max_positions=5, tied_embeddings=True)
    shapes = parameter_shapes(spec)
    assert ("model.embed_positions.weight", (5, 8)) in shapes
    assert ("model.layers.0.input_layernorm.bias", (8,)) in shapes
    assert not any("gate_proj" in n for n, _ in shapes)
    # embed 80 + pos 40 + attn 4*64 = 256 + mlp (16*8+16) + (8*16+8) = 280 + 2 norms 32 + final 16 = 704
    assert count_parameters(spec) == 704


def test_tied_embedding_appears_once():
    tied = load_model("gemma-2-9b")
    names = [n for n, _ in parameter_shapes(tied)]
    assert "lm_head.weight" not in names and names.count("model.embed_tokens.weight") == 1
    assert len(names) == len(set(names))


def test_features_a_family_cannot_name_are_refused():
    moe_gpt2 = ModelSpec(family="gpt2", hidden_size=8, num_layers=1, num_heads=2, ffn_size=8, vocab_size=10,
                         num_experts=2, top_k=1)
    with pytest.raises(UnsupportedError, match=r"family 'gpt2' has no parameter layout for MoE"):
        parameter_shapes(moe_gpt2)
    neox_pos = ModelSpec(family="gpt_neox", hidden_size=8, num_layers=1, num_heads=2, ffn_size=8,
                         vocab_size=10, max_positions=4, qk_norm=True)
    with pytest.raises(UnsupportedError, match=r"qk_norm, max_positions.*use family 'generic'"):
        count_parameters(neox_pos)
