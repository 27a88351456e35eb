"""Model presets and Hugging Face ``config.json`` files -> :class:`ModelSpec`.

A preset is a ``config.json`` shipped in ``trainmem/data/models/<name>.json``, read only when asked for.
Everything here reads JSON as data: no torch, no transformers, no network, no remote code.

Known limitations:
  - Defaults for missing keys are those of transformers 5.x config classes, written down below; a
    file (preset, path, folder, cache) must still write the sizes (:data:`_REQUIRED`).
  - Only the model types in :data:`SUPPORTED_MODEL_TYPES` are mapped; anything else is refused.
  - Options that only change numerics or masking (rope scaling, sliding windows, soft-capping) are not
    part of a ModelSpec; options that add parameters trainmem does not model (cross-attention) are refused.
"""

from __future__ import annotations

import difflib
import json
import os
import re
from importlib.resources import files
from pathlib import Path
from typing import Any, Callable, Mapping

from trainmem.errors import ConfigError, UnsupportedError
from trainmem.specs.model import ModelSpec

__all__ = [
    "SUPPORTED_MODEL_TYPES",
    "list_presets",
    "load_config_dict",
    "spec_from_hf_config",
    "load_model",
    "hf_cache_config",
]

_PRESET_SUFFIX = ".json"

# Defaults of the transformers 5.x config classes, for keys a config.json leaves out.
# Only keys that change a ModelSpec field are listed.
_DEFAULTS: dict[str, dict[str, Any]] = {
    "gpt2": {  # GPT2Config
        "vocab_size": 50257, "n_positions": 1024, "n_embd": 768, "n_layer": 12, "n_head": 12,
        "n_inner": None, "activation_function": "gelu_new", "resid_pdrop": 0.1, "embd_pdrop": 0.1,
        "attn_pdrop": 0.1, "tie_word_embeddings": True, "add_cross_attention": False,
    },
    "gpt_neox": {  # GPTNeoXConfig
        "vocab_size": 50432, "hidden_size": 6144, "num_hidden_layers": 44, "num_attention_heads": 64,
        "intermediate_size": 24576, "hidden_act": "gelu", "attention_dropout": 0.0, "hidden_dropout": 0.0,
        "max_position_embeddings": 2048, "tie_word_embeddings": False, "use_parallel_residual": True,
        "attention_bias": True, "rotary_pct": 0.25,
    },
    "llama": {  # LlamaConfig
        "vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32,
        "num_attention_heads": 32, "num_key_value_heads": None, "head_dim": None, "hidden_act": "silu",
        "tie_word_embeddings": False, "attention_bias": False, "attention_dropout": 0.0, "mlp_bias": False,
    },
    "mistral": {  # MistralConfig
        "vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
        "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": None, "hidden_act": "silu",
        "tie_word_embeddings": False, "attention_dropout": 0.0,
    },
    "qwen2": {  # Qwen2Config
        "vocab_size": 151936, "hidden_size": 4096, "intermediate_size": 22016, "num_hidden_layers": 32,
        "num_attention_heads": 32, "num_key_value_heads": 32, "head_dim": None, "hidden_act": "silu",
        "tie_word_embeddings": False, "attention_dropout": 0.0,
    },
    "gemma": {  # GemmaConfig
        "vocab_size": 256000, "hidden_size": 3072, "intermediate_size": 24576, "num_hidden_layers": 28,
        "num_attention_heads": 16, "num_key_value_heads": 16, "head_dim": 256,
        "hidden_act": "gelu_pytorch_tanh", "tie_word_embeddings": True, "attention_bias": False,
        "attention_dropout": 0.0,
    },
    "gemma2": {  # Gemma2Config (reads ``hidden_activation``, not ``hidden_act``)
        "vocab_size": 256000, "hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 26,
        "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256,
        "hidden_activation": "gelu_pytorch_tanh", "tie_word_embeddings": True, "attention_bias": False,
        "attention_dropout": 0.0, "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0,
    },
    "phi3": {  # Phi3Config (``embd_pdrop`` exists but Phi3Model applies no embedding dropout)
        "vocab_size": 32064, "hidden_size": 3072, "intermediate_size": 8192, "num_hidden_layers": 32,
        "num_attention_heads": 32, "num_key_value_heads": None, "head_dim": None, "hidden_act": "silu",
        "tie_word_embeddings": False, "attention_dropout": 0.0, "resid_pdrop": 0.0,
    },
    "bert": {  # BertConfig
        "vocab_size": 30522, "hidden_size": 768, "num_hidden_layers": 12, "num_attention_heads": 12,
        "intermediate_size": 3072, "hidden_act": "gelu", "hidden_dropout_prob": 0.1,
        "attention_probs_dropout_prob": 0.1, "max_position_embeddings": 512, "type_vocab_size": 2,
        "tie_word_embeddings": True, "add_cross_attention": False,
    },
}

# MixtralConfig and Qwen3Config share MistralConfig's and Qwen2Config's defaults for the keys above.
_DEFAULTS["mixtral"] = {**_DEFAULTS["mistral"], "num_experts_per_tok": 2, "num_local_experts": 8}
_DEFAULTS["qwen3"] = {**_DEFAULTS["qwen2"], "head_dim": 128, "attention_bias": False}

#: Keys a config class also accepts under another name (``PretrainedConfig.attribute_map``).
_ALIASES: dict[str, dict[str, str]] = {
    "gpt2": {"n_embd": "hidden_size", "n_layer": "num_hidden_layers", "n_head": "num_attention_heads",
             "n_positions": "max_position_embeddings"},
    "mixtral": {"num_local_experts": "num_experts"},
}

#: Keys a ``config.json`` file must write (or their :data:`_ALIASES` name): the sizes. transformers
#: would fill a missing one from its config class's defaults (LlamaConfig's are Llama-2-7B's), which
#: for a file is almost always a mistake. gpt2's ``n_inner`` is not here: None means 4·n_embd.
_CONFIG_CLASS = {"gpt2": "GPT2Config", "gpt_neox": "GPTNeoXConfig", "llama": "LlamaConfig (Llama-2-7B)",
                 "mistral": "MistralConfig", "mixtral": "MixtralConfig", "qwen2": "Qwen2Config",
                 "qwen3": "Qwen3Config", "gemma": "GemmaConfig", "gemma2": "Gemma2Config", "phi3": "Phi3Config",
                 "bert": "BertConfig"}
_SIZES = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size")
_REQUIRED: dict[str, tuple[str, ...]] = {
    **{t: _SIZES for t in _DEFAULTS},
    "gpt2": ("vocab_size", "n_embd", "n_layer", "n_head"),
    "mixtral": (*_SIZES, "num_local_experts", "num_experts_per_tok"),
}

#: ``ACT2FN`` names -> trainmem activation for a two-matrix MLP.
_PLAIN_ACTIVATIONS = {
    "gelu": "gelu", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu_fast": "gelu_tanh",
    "relu": "relu",
}
#: ``ACT2FN`` names -> trainmem activation for a gated MLP (act(gate) * up).
_GATED_ACTIVATIONS = {
    "silu": "swiglu", "swish": "swiglu", "gelu": "geglu", "gelu_new": "geglu",
    "gelu_pytorch_tanh": "geglu", "gelu_fast": "geglu",
}


class _Cfg:
    """A config dict read the way its transformers config class reads it."""

    def __init__(self, cfg: Mapping[str, Any], model_type: str) -> None:
        self.cfg = cfg
        self.model_type = model_type
        self.defaults = _DEFAULTS[model_type]
        self.aliases = _ALIASES.get(model_type, {})

    def __call__(self, key: str) -> Any:
        if key in self.cfg:
            return self.cfg[key]
        alias = self.aliases.get(key)
        if alias is not None and alias in self.cfg:
            return self.cfg[alias]
        return self.defaults[key]

    def activation(self, key: str, *, gated: bool) -> str:
        value = self(key)
        table = _GATED_ACTIVATIONS if gated else _PLAIN_ACTIVATIONS
        if not isinstance(value, str) or value not in table:
            kind = "gated" if gated else "two-matrix"
            raise UnsupportedError(
                f"{self.model_type} {key}={value!r} is not modelled for a {kind} MLP "
                f"(supported: {', '.join(table)})"
            )
        return table[value]

    def refuse_if(self, key: str, why: str) -> None:
        if self(key):
            raise UnsupportedError(f"{self.model_type} {key}={self(key)!r}: {why}")


def _heads(c: _Cfg) -> dict[str, Any]:
    """Head counts as the Llama-style attention modules read them; ``None`` means "derive"."""
    heads = c("num_attention_heads")
    kv = c("num_key_value_heads")
    return {
        "num_heads": heads,
        "num_kv_heads": heads if kv is None else kv,
        # every family below takes config.head_dim when set, else hidden_size // num_attention_heads
        "head_dim": c("head_dim") or None,
    }


def _llama_like(c: _Cfg, *, act_key: str = "hidden_act", bias_key: str | None = "attention_bias") -> dict:
    attention_bias = c(bias_key) if bias_key else False
    return {
        "hidden_size": c("hidden_size"),
        "num_layers": c("num_hidden_layers"),
        **_heads(c),
        "ffn_size": c("intermediate_size"),
        "activation": c.activation(act_key, gated=True),
        "norm": "rmsnorm",
        "qkv_bias": attention_bias,
        "out_bias": attention_bias,
        "tied_embeddings": c("tie_word_embeddings"),
        "vocab_size": c("vocab_size"),
        "attn_dropout": c("attention_dropout"),
    }


def _gpt2(c: _Cfg) -> dict:
    c.refuse_if("add_cross_attention", "cross-attention layers are not modelled")
    hidden = c("n_embd")
    inner = c("n_inner")
    return {
        "hidden_size": hidden, "num_layers": c("n_layer"), "num_heads": c("n_head"),
        "ffn_size": 4 * hidden if inner is None else inner,
        "activation": c.activation("activation_function", gated=False),
        "norm": "layernorm", "qkv_bias": True, "out_bias": True, "mlp_bias": True, "norm_bias": True,
        "tied_embeddings": c("tie_word_embeddings"), "vocab_size": c("vocab_size"),
        "max_positions": c("n_positions"),
        "attn_dropout": c("attn_pdrop"), "hidden_dropout": c("resid_pdrop"), "embd_dropout": c("embd_pdrop"),
    }


def _gpt_neox(c: _Cfg) -> dict:
    attention_bias = c("attention_bias")
    return {
        "hidden_size": c("hidden_size"), "num_layers": c("num_hidden_layers"),
        "num_heads": c("num_attention_heads"), "ffn_size": c("intermediate_size"),
        "activation": c.activation("hidden_act", gated=False),
        "norm": "layernorm", "qkv_bias": attention_bias, "out_bias": attention_bias, "mlp_bias": True,
        "norm_bias": True, "tied_embeddings": c("tie_word_embeddings"), "vocab_size": c("vocab_size"),
        # emb_dropout, post_attention_dropout and post_mlp_dropout all use hidden_dropout
        "attn_dropout": c("attention_dropout"), "hidden_dropout": c("hidden_dropout"),
        "embd_dropout": c("hidden_dropout"),
        "parallel_residual": c("use_parallel_residual"),
        "rotary_dim": int(c("hidden_size") // c("num_attention_heads") * _rotary_fraction(c)),
    }


def _rotary_fraction(c: _Cfg) -> float:
    """GPT-NeoX's rotated share of each head: ``rotary_pct`` (4.x) or
    ``rope_parameters.partial_rotary_factor`` (5.x)."""
    rope = c.cfg.get("rope_parameters") or {}
    if "partial_rotary_factor" in rope:
        return float(rope["partial_rotary_factor"])
    return float(c("rotary_pct"))


def _llama(c: _Cfg) -> dict:
    return {**_llama_like(c), "mlp_bias": c("mlp_bias")}


def _mistral(c: _Cfg) -> dict:
    return _llama_like(c, bias_key=None)


def _mixtral(c: _Cfg) -> dict:
    return {
        **_llama_like(c, bias_key=None),
        "num_experts": c("num_local_experts"), "top_k": c("num_experts_per_tok"),
        "expert_ffn_size": c("intermediate_size"),
    }


def _qwen2(c: _Cfg) -> dict:
    return {**_llama_like(c, bias_key=None), "qkv_bias": True}  # q, k, v carry a bias; o_proj does not


def _qwen3(c: _Cfg) -> dict:
    return {**_llama_like(c), "qk_norm": True}


def _gemma(c: _Cfg) -> dict:
    return _llama_like(c)


def _gemma2(c: _Cfg) -> dict:
    return {**_llama_like(c, act_key="hidden_activation"),
            "attn_softcap": float(c("attn_logit_softcapping") or 0.0),
            "logit_softcap": float(c("final_logit_softcapping") or 0.0)}


def _phi3(c: _Cfg) -> dict:
    return {**_llama_like(c, bias_key=None), "hidden_dropout": c("resid_pdrop")}


def _bert(c: _Cfg) -> dict:
    c.refuse_if("add_cross_attention", "cross-attention layers are not modelled")
    return {
        "arch": "encoder", "hidden_size": c("hidden_size"), "num_layers": c("num_hidden_layers"),
        "num_heads": c("num_attention_heads"), "ffn_size": c("intermediate_size"),
        "activation": c.activation("hidden_act", gated=False),
        "norm": "layernorm", "qkv_bias": True, "out_bias": True, "mlp_bias": True, "norm_bias": True,
        "tied_embeddings": c("tie_word_embeddings"), "vocab_size": c("vocab_size"),
        "max_positions": c("max_position_embeddings"), "type_vocab_size": c("type_vocab_size"),
        # BertEmbeddings, BertSelfOutput and BertOutput all drop out with hidden_dropout_prob
        "attn_dropout": c("attention_probs_dropout_prob"), "hidden_dropout": c("hidden_dropout_prob"),
        "embd_dropout": c("hidden_dropout_prob"),
    }


_MAPPERS: dict[str, Callable[[_Cfg], dict]] = {
    "gpt2": _gpt2, "gpt_neox": _gpt_neox, "llama": _llama, "mistral": _mistral, "mixtral": _mixtral,
    "qwen2": _qwen2, "qwen3": _qwen3, "gemma": _gemma, "gemma2": _gemma2, "phi3": _phi3, "bert": _bert,
}
#: ``model_type`` values :func:`spec_from_hf_config` maps.
SUPPORTED_MODEL_TYPES = tuple(_MAPPERS)


# presets and files -------------------------------------------------------------------------------
def _preset_dir():
    return files("trainmem") / "data" / "models"


def list_presets() -> list[str]:
    """Names of the bundled model presets, sorted."""
    return sorted(
        entry.name[: -len(_PRESET_SUFFIX)]
        for entry in _preset_dir().iterdir()
        if entry.name.endswith(_PRESET_SUFFIX)
    )


def _parse(text: str, where: str) -> dict:
    try:
        cfg = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(
            f"{where}: invalid JSON at line {exc.lineno} column {exc.colno}: {exc.msg}"
        ) from None
    except RecursionError:
        raise ConfigError(f"{where}: JSON nested too deeply") from None
    if not isinstance(cfg, dict):
        raise ConfigError(f"{where}: expected a JSON object (a config.json), got a {type(cfg).__name__}")
    if "model_type" not in cfg:
        raise ConfigError(f"{where}: no 'model_type' key, so the architecture is unknown")
    if not isinstance(cfg["model_type"], str):
        raise ConfigError(f"{where}: model_type={cfg['model_type']!r} is not a string")
    _check_sizes(cfg, where)
    return cfg


def _check_sizes(cfg: dict, where: str) -> None:
    """Refuse a file that leaves out a size-defining key (:data:`_REQUIRED`), naming every one."""
    model_type = cfg["model_type"]
    aliases = _ALIASES.get(model_type, {})
    missing = [k for k in _REQUIRED.get(model_type, ()) if k not in cfg and aliases.get(k) not in cfg]
    if missing:
        defaults = ", ".join(f"{k}={_DEFAULTS[model_type][k]}" for k in missing)
        raise ConfigError(f"{where}: model_type={model_type!r} without {', '.join(missing)}; transformers would "
                          f"take {_CONFIG_CLASS[model_type]}'s defaults ({defaults}), almost always a mistake in a "
                          f"file: write them in the file")


def _read_file(path: Path) -> dict:
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path}: not UTF-8 text (byte {exc.start})") from None
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read ({exc.strerror or exc})") from None
    return _parse(text, str(path))


def _unknown(name: str) -> ConfigError:
    presets = list_presets()
    close = difflib.get_close_matches(name, presets, n=3, cutoff=0.6)
    hint = f"did you mean {', '.join(close)}? " if close else ""
    return ConfigError(
        f"unknown model {name!r}: not a preset, a config.json or a folder holding one; "
        f"{hint}presets (list_presets()): {', '.join(presets)}"
    )


_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*$")  # ORG/NAME, as on the Hub


def _hf_hub_caches() -> list[Path]:
    """Where huggingface_hub keeps its cache, in its own order (``huggingface_hub/constants.py``:
    ``HF_HUB_CACHE``, then ``HF_HOME/hub``, then ``XDG_CACHE_HOME/huggingface/hub``, then
    ``~/.cache/huggingface/hub``)."""
    env = os.environ
    if env.get("HF_HUB_CACHE") or env.get("HUGGINGFACE_HUB_CACHE"):
        return [Path(env.get("HF_HUB_CACHE") or env["HUGGINGFACE_HUB_CACHE"]).expanduser()]
    if env.get("HF_HOME"):
        return [Path(env["HF_HOME"]).expanduser() / "hub"]
    cache = Path(env["XDG_CACHE_HOME"]).expanduser() if env.get("XDG_CACHE_HOME") else Path.home() / ".cache"
    return [cache / "huggingface" / "hub"]


def hf_cache_config(repo_id: str) -> Path:
    """The ``config.json`` of ``ORG/NAME`` in the local Hugging Face cache: the snapshot
    ``refs/main`` names, else the newest snapshot that has one. Files only, never the network."""
    hub = _hf_hub_caches()[0]
    repo = hub / ("models--" + repo_id.replace("/", "--"))
    snapshots = repo / "snapshots"
    ref = repo / "refs" / "main"
    try:
        if ref.is_file():
            pinned = snapshots / ref.read_text(encoding="utf-8").strip() / "config.json"
            if pinned.is_file():
                return pinned
        found = [c for c in snapshots.glob("*/config.json") if c.is_file()] if snapshots.is_dir() else []
    except OSError:
        found = []
    if found:
        return max(found, key=lambda c: c.stat().st_mtime)
    raise ConfigError(
        f"{repo_id}: not a local path, and no config.json for it in the Hugging Face cache ({hub}); "
        f"trainmem never downloads: fetch it with `huggingface-cli download {repo_id} config.json`, "
        f"or pass the path of a config.json"
    )


def load_config_dict(name_or_path: str) -> dict:
    """The ``config.json`` dict of a preset name, a ``config.json`` path, a model folder, or a
    Hugging Face ``ORG/NAME`` whose config is in the local cache (:func:`hf_cache_config`).

    A preset name wins over a same-named folder in the working directory; write ``./name`` for the folder.
    The file is read as data only: ``auto_map`` and remote code are never followed.
    """
    if not isinstance(name_or_path, str) or not name_or_path:
        raise ConfigError(f"model={name_or_path!r}: expected a preset name or a path")
    if name_or_path in list_presets():
        resource = _preset_dir() / f"{name_or_path}{_PRESET_SUFFIX}"
        return _parse(resource.read_text(encoding="utf-8"), f"preset {name_or_path}")
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        config = path / "config.json"
        if not config.is_file():
            raise ConfigError(f"{path}: folder has no config.json")
        return _read_file(config)
    if path.is_file():
        return _read_file(path)
    if _REPO_ID.match(name_or_path):
        return _read_file(hf_cache_config(name_or_path))
    looks_like_path = "/" in name_or_path or "\\" in name_or_path or name_or_path.endswith(".json")
    if looks_like_path:
        raise ConfigError(
            f"{name_or_path}: no such file or folder (trainmem reads local config.json files only, "
            f"it never downloads)"
        )
    raise _unknown(name_or_path)


def spec_from_hf_config(cfg: Mapping[str, Any], name: str = "custom") -> ModelSpec:
    """Map a Hugging Face ``config.json`` dict onto a :class:`ModelSpec` (``family`` = ``model_type``).

    Keys the dict leaves out take the transformers config class defaults. Raises
    :class:`UnsupportedError` for a model type or option trainmem does not model, and
    :class:`~trainmem.errors.SpecError` when the mapped values are inconsistent.
    """
    if not isinstance(cfg, Mapping):
        raise ConfigError(f"{name}: expected a config dict, got a {type(cfg).__name__}")
    model_type = cfg.get("model_type")
    if model_type not in _MAPPERS:
        remote = " (it has auto_map, but trainmem never runs remote code)" if "auto_map" in cfg else ""
        raise UnsupportedError(
            f"{name}: model_type={model_type!r} is not supported{remote}; "
            f"supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    fields = _MAPPERS[model_type](_Cfg(cfg, model_type))
    return ModelSpec(name=name, family=model_type, **fields)


def load_model(name_or_path: str) -> ModelSpec:
    """:func:`load_config_dict` then :func:`spec_from_hf_config`, named after the preset or path."""
    return spec_from_hf_config(load_config_dict(name_or_path), name=name_or_path)
