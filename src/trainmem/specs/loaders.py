"""Model presets and Hugging Face ``config.json`` files -> :class:`ModelSpec`.

A preset is a ``config.json`` shipped in ``trainmem/data/models/<name>.json``, read only when asked for.
Everything here reads JSON as data: no torch, no transformers, no network, no remote code.

Known limitations:
  - Defaults for missing keys are those of transformers 5.x config classes, written down in each
    family's module (``trainmem/families/``); a file (preset, path, folder, cache) must still write
    the sizes (``ConfigSchema.required``).
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
from typing import Any, Mapping

from trainmem.errors import ConfigError, UnsupportedError
from trainmem.families import config_families
from trainmem.families.config import ConfigReader, read_fields
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

#: ``model_type`` values :func:`spec_from_hf_config` maps: the registered families with a config
#: reader (``trainmem/families/``: each family's defaults, aliases, required keys and reader).
SUPPORTED_MODEL_TYPES = tuple(config_families())


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
    """Refuse a file that leaves out a size-defining key (``ConfigSchema.required``), naming every one."""
    model_type = cfg["model_type"]
    family = config_families().get(model_type)
    if family is None:
        return
    schema = family.config
    missing = [k for k in schema.required if k not in cfg and schema.aliases.get(k) not in cfg]
    if missing:
        defaults = ", ".join(f"{k}={schema.defaults[k]}" for k in missing)
        raise ConfigError(f"{where}: model_type={model_type!r} without {', '.join(missing)}; transformers would "
                          f"take {schema.config_class}'s defaults ({defaults}), almost always a mistake in a "
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
    family = config_families().get(model_type) if isinstance(model_type, str) else None
    if family is None:
        remote = " (it has auto_map, but trainmem never runs remote code)" if "auto_map" in cfg else ""
        raise UnsupportedError(
            f"{name}: model_type={model_type!r} is not supported{remote} by the estimator's hf rules "
            f"(supported: {', '.join(SUPPORTED_MODEL_TYPES)}); `trainmem estimate --profile traced` (one device) "
            f"and `trainmem trace` build it from transformers instead"
        )
    fields = read_fields(ConfigReader(cfg, model_type, family.config))
    return ModelSpec(name=name, family=family.name, **fields, **_task_head(cfg))


#: ``architectures[0]`` suffix -> ModelSpec.head (transformers' Auto classes; models/hf.py HEADS)
_HEAD_SUFFIXES = {"ForSequenceClassification": "seq-cls", "ForTokenClassification": "token-cls"}


def _task_head(cfg: Mapping[str, Any]) -> dict:
    """A classifier's config names its head in ``architectures`` and its classes in ``num_labels`` or
    ``id2label`` (``PretrainedConfig``: num_labels = len(id2label), default 2); the trace builds the
    same head from the same keys (``models/hf.py`` ``choose_head``)."""
    archs = cfg.get("architectures") or []
    arch = archs[0] if isinstance(archs, list) and archs and isinstance(archs[0], str) else ""
    head = next((h for suffix, h in _HEAD_SUFFIXES.items() if arch.endswith(suffix)), None)
    if head is None:
        return {}
    out: dict[str, Any] = {"head": head}
    labels = cfg.get("num_labels")
    if labels is None and isinstance(cfg.get("id2label"), Mapping):
        labels = len(cfg["id2label"])
    if labels is not None:
        out["num_labels"] = labels
    if cfg.get("classifier_dropout") is not None:
        out["classifier_dropout"] = cfg["classifier_dropout"]
    return out


def load_model(name_or_path: str) -> ModelSpec:
    """:func:`load_config_dict` then :func:`spec_from_hf_config`, named after the preset or path."""
    return spec_from_hf_config(load_config_dict(name_or_path), name=name_or_path)
