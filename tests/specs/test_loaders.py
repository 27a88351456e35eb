"""Presets and config.json loading: every preset loads, every field maps, every bad input says why."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from trainmem.errors import ConfigError, SpecError, UnsupportedError
from trainmem.specs.loaders import (
    SUPPORTED_MODEL_TYPES,
    list_presets,
    load_config_dict,
    load_model,
    spec_from_hf_config,
)
from trainmem.specs.model import ModelSpec

REQUIRED_PRESETS = {
    "gpt2", "gpt2-xl", "bert-large", "llama-2-7b", "llama-2-13b", "llama-2-70b", "llama-3-8b",
    "llama-3-70b", "llama-3.1-405b", "mistral-7b", "mixtral-8x7b", "qwen2.5-7b", "gemma-2-9b",
    "phi-3-mini", "gpt3-175b",
}


def _write(tmp_path, text: str, name: str = "config.json"):
    path = tmp_path / name
    path.write_text(text)
    return path


# presets -------------------------------------------------------------------------------------------
def test_required_presets_are_bundled():
    assert REQUIRED_PRESETS <= set(list_presets())
    assert list_presets() == sorted(list_presets())


@pytest.mark.parametrize("name", sorted(REQUIRED_PRESETS))
def test_every_preset_loads(name):
    cfg = load_config_dict(name)
    spec = load_model(name)
    assert isinstance(spec, ModelSpec)
    assert spec.name == name
    assert spec.family == cfg["model_type"]
    assert cfg["model_type"] in SUPPORTED_MODEL_TYPES


def test_preset_dict_is_a_fresh_copy():
    load_config_dict("gpt2")["n_embd"] = 1
    assert load_config_dict("gpt2")["n_embd"] == 768


def test_llama_2_7b_preset_fields():
    spec = load_model("llama-2-7b")
    assert (spec.hidden_size, spec.num_layers, spec.num_heads, spec.num_kv_heads, spec.head_dim) == (
        4096, 32, 32, 32, 128)
    assert (spec.ffn_size, spec.vocab_size, spec.activation, spec.norm) == (11008, 32000, "swiglu", "rmsnorm")
    assert not spec.tied_embeddings and spec.max_positions == 0


def test_published_shapes_of_presets():
    # (hidden, layers, heads, kv heads, ffn, vocab) from the model cards' config.json
    expected = {
        "llama-3-8b": (4096, 32, 32, 8, 14336, 128256),
        "llama-3.1-405b": (16384, 126, 128, 8, 53248, 128256),
        "mistral-7b": (4096, 32, 32, 8, 14336, 32000),
        "qwen2.5-7b": (3584, 28, 28, 4, 18944, 152064),
        "gemma-2-9b": (3584, 42, 16, 8, 14336, 256000),
        "phi-3-mini": (3072, 32, 32, 32, 8192, 32064),
        "gpt3-175b": (12288, 96, 96, 96, 4 * 12288, 50257),
        "gpt2-xl": (1600, 48, 25, 25, 6400, 50257),
    }
    for name, dims in expected.items():
        s = load_model(name)
        got = (s.hidden_size, s.num_layers, s.num_heads, s.num_kv_heads, s.ffn_size, s.vocab_size)
        assert got == dims, name
    assert load_model("gemma-2-9b").head_dim == 256
    assert load_model("gemma-2-9b").tied_embeddings
    assert load_model("qwen2.5-7b").qkv_bias and not load_model("qwen2.5-7b").out_bias


# field mapping -------------------------------------------------------------------------------------
def test_gpt2_defaults_and_mapping():
    spec = spec_from_hf_config({"model_type": "gpt2"}, name="g")
    # GPT2Config defaults; n_inner None -> 4 * n_embd; gelu_new is GELU's tanh approximation
    assert spec == ModelSpec(
        name="g", family="gpt2", hidden_size=768, num_layers=12, num_heads=12, ffn_size=3072,
        activation="gelu_tanh", norm="layernorm", qkv_bias=True, out_bias=True, mlp_bias=True,
        norm_bias=True, tied_embeddings=True, vocab_size=50257, max_positions=1024,
        attn_dropout=0.1, hidden_dropout=0.1, embd_dropout=0.1,
    )


def test_gpt2_explicit_keys_and_aliases():
    spec = spec_from_hf_config({
        "model_type": "gpt2", "hidden_size": 64, "n_layer": 2, "num_attention_heads": 4, "n_inner": 100,
        "activation_function": "relu", "attn_pdrop": 0.0, "resid_pdrop": 0.2, "embd_pdrop": 0.3,
        "tie_word_embeddings": False, "max_position_embeddings": 77,
    })
    assert (spec.hidden_size, spec.num_layers, spec.num_heads, spec.ffn_size) == (64, 2, 4, 100)
    assert (spec.activation, spec.max_positions, spec.tied_embeddings) == ("relu", 77, False)
    assert (spec.attn_dropout, spec.hidden_dropout, spec.embd_dropout) == (0.0, 0.2, 0.3)


def test_gpt_neox_mapping():
    spec = spec_from_hf_config({
        "model_type": "gpt_neox", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
        "intermediate_size": 256, "vocab_size": 100, "hidden_dropout": 0.1, "attention_dropout": 0.2,
    })
    assert spec.parallel_residual and spec.qkv_bias and spec.out_bias and spec.mlp_bias and spec.norm_bias
    assert (spec.activation, spec.norm, spec.tied_embeddings, spec.max_positions) == (
        "gelu", "layernorm", False, 0)
    assert (spec.attn_dropout, spec.hidden_dropout, spec.embd_dropout) == (0.2, 0.1, 0.1)
    off = spec_from_hf_config({"model_type": "gpt_neox", "use_parallel_residual": False,
                               "attention_bias": False})
    assert not off.parallel_residual and not off.qkv_bias and not off.out_bias and off.mlp_bias
    assert (off.hidden_size, off.num_layers, off.ffn_size, off.vocab_size) == (6144, 44, 24576, 50432)


def test_llama_mapping_and_defaults():
    spec = spec_from_hf_config({"model_type": "llama", "attention_bias": True, "mlp_bias": True,
                                "attention_dropout": 0.1, "head_dim": 64})
    assert (spec.hidden_size, spec.num_layers, spec.num_heads, spec.num_kv_heads) == (4096, 32, 32, 32)
    assert (spec.ffn_size, spec.vocab_size, spec.head_dim) == (11008, 32000, 64)
    assert spec.qkv_bias and spec.out_bias and spec.mlp_bias and spec.attn_dropout == 0.1
    assert (spec.activation, spec.norm, spec.max_positions) == ("swiglu", "rmsnorm", 0)
    # an explicit null means "same as num_attention_heads", as LlamaConfig.__post_init__ does
    assert spec_from_hf_config({"model_type": "llama", "num_key_value_heads": None}).num_kv_heads == 32


def test_class_defaults_differ_by_model_type():
    # a missing num_key_value_heads is 8 for Mistral/Mixtral but 32 for Qwen2/Qwen3
    assert spec_from_hf_config({"model_type": "mistral"}).num_kv_heads == 8
    assert spec_from_hf_config({"model_type": "mixtral"}).num_kv_heads == 8
    assert spec_from_hf_config({"model_type": "qwen2"}).num_kv_heads == 32
    assert spec_from_hf_config({"model_type": "qwen3"}).head_dim == 128
    gemma = spec_from_hf_config({"model_type": "gemma"})
    assert (gemma.head_dim, gemma.activation, gemma.tied_embeddings, gemma.vocab_size) == (
        256, "geglu", True, 256000)
    gemma2 = spec_from_hf_config({"model_type": "gemma2"})
    assert (gemma2.hidden_size, gemma2.num_kv_heads, gemma2.ffn_size) == (2304, 4, 9216)


def test_mixtral_experts():
    spec = spec_from_hf_config({"model_type": "mixtral", "num_local_experts": 4, "num_experts_per_tok": 1,
                                "intermediate_size": 128})
    assert (spec.num_experts, spec.top_k, spec.expert_ffn_size, spec.ffn_size) == (4, 1, 128, 128)
    # MixtralConfig.attribute_map: num_experts -> num_local_experts
    assert spec_from_hf_config({"model_type": "mixtral", "num_experts": 3}).num_experts == 3
    assert not spec.qkv_bias and not spec.mlp_bias


def test_qwen_biases_and_qk_norm():
    qwen2 = spec_from_hf_config({"model_type": "qwen2", "attention_bias": False})
    assert qwen2.qkv_bias and not qwen2.out_bias and not qwen2.qk_norm  # attention_bias is not read
    qwen3 = spec_from_hf_config({"model_type": "qwen3", "attention_bias": True})
    assert qwen3.qk_norm and qwen3.qkv_bias and qwen3.out_bias


def test_gemma_activation_keys():
    # Gemma reads hidden_act (legacy "gelu" means the tanh GELU), Gemma2 reads hidden_activation
    assert spec_from_hf_config({"model_type": "gemma", "hidden_act": "gelu"}).activation == "geglu"
    assert spec_from_hf_config({"model_type": "gemma2", "hidden_act": "silu"}).activation == "geglu"
    assert spec_from_hf_config({"model_type": "gemma2", "hidden_activation": "silu"}).activation == "swiglu"


def test_phi3_dropouts():
    spec = spec_from_hf_config({"model_type": "phi3", "resid_pdrop": 0.1, "embd_pdrop": 0.2,
                                "attention_dropout": 0.3, "num_key_value_heads": 8})
    # Phi3Model has no embedding dropout module: embd_pdrop is read by nothing
    assert (spec.hidden_dropout, spec.embd_dropout, spec.attn_dropout) == (0.1, 0.0, 0.3)
    assert (spec.num_heads, spec.num_kv_heads, spec.vocab_size) == (32, 8, 32064)


def test_bert_mapping():
    spec = spec_from_hf_config({"model_type": "bert", "hidden_dropout_prob": 0.2,
                                "attention_probs_dropout_prob": 0.3, "type_vocab_size": 3})
    assert spec == ModelSpec(
        family="bert", arch="encoder", hidden_size=768, num_layers=12, num_heads=12, ffn_size=3072,
        activation="gelu", norm="layernorm", qkv_bias=True, out_bias=True, mlp_bias=True, norm_bias=True,
        tied_embeddings=True, vocab_size=30522, max_positions=512, type_vocab_size=3,
        attn_dropout=0.3, hidden_dropout=0.2, embd_dropout=0.2,
    )


# errors --------------------------------------------------------------------------------------------
def test_unknown_preset_suggests_close_names():
    with pytest.raises(ConfigError) as info:
        load_config_dict("llama-2-7")
    message = str(info.value)
    assert "'llama-2-7'" in message and "did you mean llama-2-7b" in message
    assert "list_presets()" in message and "\n" not in message


def test_unknown_preset_without_close_name_still_lists_presets():
    with pytest.raises(ConfigError, match=r"unknown model 'zzzz'.*presets \(list_presets\(\)\): bert-large"):
        load_model("zzzz")


def test_hub_id_is_not_downloaded(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))  # an empty cache (tests/specs/test_hf_cache.py reads one)
    with pytest.raises(ConfigError, match=r"Llama-2-7b-hf: not a local path.*never downloads"):
        load_config_dict("meta-llama/Llama-2-7b-hf")


def test_missing_json_file(tmp_path):
    missing = tmp_path / "nope.json"
    with pytest.raises(ConfigError, match=rf"{missing}: no such file"):
        load_config_dict(str(missing))


@pytest.mark.parametrize(("text", "where"), [
    ('{"model_type": "llama",\n "hidden_size": 4096,,}', "line 2 column 22"),
    ('{"model_type": "llama", "hidden_size"', "line 1 column 38"),  # truncated
    ("", "line 1 column 1"),
])
def test_malformed_json_names_file_and_position(tmp_path, text, where):
    path = _write(tmp_path, text)
    with pytest.raises(ConfigError) as info:
        load_config_dict(str(path))
    assert str(path) in str(info.value) and where in str(info.value)


def test_json_list_is_refused(tmp_path):
    path = _write(tmp_path, '[{"model_type": "llama"}]')
    with pytest.raises(ConfigError, match=r"expected a JSON object \(a config.json\), got a list"):
        load_config_dict(str(path))


def test_missing_or_bad_model_type(tmp_path):
    with pytest.raises(ConfigError, match=r"no 'model_type' key"):
        load_config_dict(str(_write(tmp_path, '{"hidden_size": 8}')))
    with pytest.raises(ConfigError, match=r"model_type=7 is not a string"):
        load_config_dict(str(_write(tmp_path, '{"model_type": 7}')))


def test_not_utf8(tmp_path):
    path = tmp_path / "config.json"
    path.write_bytes(b'{"model_type": "\xff"}')
    with pytest.raises(ConfigError, match="not UTF-8"):
        load_config_dict(str(path))


LLAMA_SIZES = {"model_type": "llama", "vocab_size": 128, "hidden_size": 64, "num_hidden_layers": 2,
               "num_attention_heads": 4, "intermediate_size": 128}


def test_model_folder(tmp_path):
    _write(tmp_path, json.dumps(LLAMA_SIZES))
    assert load_model(str(tmp_path)).num_layers == 2
    assert load_model(str(tmp_path / "config.json")).name == str(tmp_path / "config.json")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ConfigError, match=rf"{empty}: folder has no config.json"):
        load_config_dict(str(empty))


def test_unsupported_model_type_lists_supported(tmp_path):
    path = _write(tmp_path, json.dumps({"model_type": "t5", "d_model": 512}))
    with pytest.raises(UnsupportedError) as info:
        load_model(str(path))
    message = str(info.value)
    assert "model_type='t5'" in message and str(path) in message
    assert all(t in message for t in SUPPORTED_MODEL_TYPES)


def test_auto_map_is_data_only():
    remote = {"model_type": "internlm2",
              "auto_map": {"AutoConfig": "configuration_internlm2.InternLM2Config"}}
    with pytest.raises(UnsupportedError, match="never runs remote code"):
        spec_from_hf_config(remote)
    known = {"model_type": "phi3", "auto_map": {"AutoConfig": "configuration_phi3.Phi3Config"}}
    assert spec_from_hf_config(known).family == "phi3"


def test_unsupported_options_are_refused():
    with pytest.raises(UnsupportedError, match=r"gpt2 add_cross_attention=True: cross-attention"):
        spec_from_hf_config({"model_type": "gpt2", "add_cross_attention": True})
    with pytest.raises(UnsupportedError, match=r"llama hidden_act='relu' is not modelled for a gated MLP"):
        spec_from_hf_config({"model_type": "llama", "hidden_act": "relu"})
    with pytest.raises(UnsupportedError, match=r"bert hidden_act='silu'"):
        spec_from_hf_config({"model_type": "bert", "hidden_act": "silu"})


def test_inconsistent_values_are_spec_errors():
    # Qwen2Config defaults num_key_value_heads to 32, which cannot serve 4 query heads
    with pytest.raises(SpecError, match=r"num_kv_heads=32: must divide num_heads=4"):
        spec_from_hf_config({"model_type": "qwen2", "num_attention_heads": 4, "hidden_size": 64})
    with pytest.raises(SpecError, match=r"tied_embeddings='no'"):
        spec_from_hf_config({"model_type": "llama", "tie_word_embeddings": "no"})


def test_spec_from_non_dict():
    with pytest.raises(ConfigError, match="expected a config dict, got a list"):
        spec_from_hf_config([])  # type: ignore[arg-type]


def test_loaders_import_no_torch():
    code = ("import sys, trainmem.specs.loaders as l; l.load_model('mixtral-8x7b'); "
            "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env)
    assert out.stdout.strip() == "[]"


@pytest.mark.parametrize("model_type", SUPPORTED_MODEL_TYPES)
def test_a_file_without_its_sizes_is_refused_naming_every_one(tmp_path, model_type):
    path = _write(tmp_path, json.dumps({"model_type": model_type}))
    with pytest.raises(ConfigError) as err:
        load_model(str(path))
    msg = str(err.value)
    assert msg.startswith(f"{path}: model_type={model_type!r} without vocab_size, ") and "\n" not in msg
    names = ("n_embd", "n_layer", "n_head") if model_type in ("gpt2", "gpt_bigcode") else \
        ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size")
    assert all(n in msg for n in names) and "defaults" in msg and "write them in the file" in msg


def test_missing_sizes_message_names_llama_2_7b_and_only_what_is_missing(tmp_path):
    path = _write(tmp_path, json.dumps({k: v for k, v in LLAMA_SIZES.items() if k != "intermediate_size"}))
    with pytest.raises(ConfigError, match=r"without intermediate_size; transformers would take "
                                          r"LlamaConfig \(Llama-2-7B\)'s defaults \(intermediate_size=11008\)"):
        load_model(str(path))


def test_sizes_under_an_alias_or_derivable_are_accepted(tmp_path):
    # gpt2 reads hidden_size as n_embd (attribute_map); n_inner=None is 4·n_embd, not a default size
    cfg = {"model_type": "gpt2", "vocab_size": 100, "hidden_size": 64, "n_layer": 2, "n_head": 4}
    spec = load_model(str(_write(tmp_path, json.dumps(cfg))))
    assert (spec.hidden_size, spec.ffn_size) == (64, 256)  # 4 · 64


def test_a_dict_still_takes_the_class_defaults():
    # the refusal is for files: a dict in code is read the way transformers reads it
    assert spec_from_hf_config({"model_type": "llama"}).vocab_size == 32000
