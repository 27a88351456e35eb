"""A torchtitan job config TOML -> overrides.

Read: ``[model] name/flavor`` (Llama 2/3 flavors map to trainmem presets) or ``hf_assets_path`` (a
folder holding config.json); ``[training] local_batch_size`` (older: ``batch_size``), ``seq_len``,
``mixed_precision_param`` (``bfloat16`` -> ``amp-bf16``: FSDP2 keeps fp32 sharded parameters,
gradients and optimizer states and computes in bf16); ``[parallelism]`` degrees, the pipeline
schedule; ``[activation_checkpoint] mode`` and ``selective_ac_option`` (``op`` -> selective, an
integer k -> every k-th block); ``[optimizer] name``.

torchtitan always applies sequence parallelism with tensor parallelism, so ``tp > 1`` sets ``sp``.
Other tables and keys (job, metrics, checkpoint, ...) do not change memory and are ignored.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from trainmem.errors import ConfigError
from trainmem.inputs._common import answer, load_toml, positive_int, table, typed

__all__ = ["read_torchtitan"]

_FLAVORS = {
    ("llama3", "8b"): "llama-3-8b", ("llama3", "70b"): "llama-3-70b", ("llama3", "405b"): "llama-3.1-405b",
    ("llama2", "7b"): "llama-2-7b", ("llama2", "13b"): "llama-2-13b", ("llama2", "70b"): "llama-2-70b",
}
_SCHEDULES = {"gpipe": "gpipe", "1f1b": "1f1b", "interleaved1f1b": "interleaved", "loopedbfs": "interleaved",
              "interleavedzerobubble": "zero-bubble", "zbvzerobubble": "zero-bubble"}
_PRECISION = {"bfloat16": "amp-bf16", "float16": "amp-fp16", "float32": "fp32"}
_OPTIMIZERS = {"adamw": "adamw", "adam": "adam", "sgd": "sgd"}


def read_torchtitan(path: str | Path) -> dict:
    """Overrides from a torchtitan job config file (see the module docstring)."""
    return torchtitan_overrides(load_toml(path, "torchtitan config"), str(path))


def torchtitan_overrides(cfg: dict, where: str = "torchtitan") -> dict:
    raw: dict[str, Any] = {}
    notes: list[str] = []
    sec: dict[str, dict[str, Any]] = {"model": {}, "step": {}, "impl": {}, "parallel": {}}

    def get(section: str, key: str, kind) -> Any:
        value = table(cfg, section, where).get(key)
        if value is None:
            return None
        raw[f"{section}.{key}"] = value
        return typed(where, f"[{section}] {key}", value, kind)

    _model(get, sec["model"], notes)
    training, par = sec["step"], sec["parallel"]
    batch = get("training", "local_batch_size", int) or get("training", "batch_size", int)
    if batch is not None:
        training["batch"] = positive_int(where, "[training] local_batch_size", batch)
    seq = get("training", "seq_len", int)
    if seq is not None:
        training["seq"] = positive_int(where, "[training] seq_len", seq)
    mp = get("training", "mixed_precision_param", str) or get("parallelism", "mixed_precision_param", str)
    if mp is not None:
        if mp not in _PRECISION:
            raise ConfigError(f"{where}: mixed_precision_param={mp!r} must be one of {', '.join(_PRECISION)}")
        training["precision"] = _PRECISION[mp]
    opt = get("optimizer", "name", str)
    if opt is not None:
        if opt.lower() in _OPTIMIZERS:
            training["optimizer"] = _OPTIMIZERS[opt.lower()]
        else:
            notes.append(f"[optimizer] name={opt!r} is not modelled")

    _parallel(get, par, notes, where)
    _checkpoint(get, sec["impl"], notes, where)
    return answer("torchtitan", where, raw, sec, notes)


def _model(get, model: dict, notes: list[str]) -> None:
    name, flavor = get("model", "name", str), get("model", "flavor", str)
    assets = get("model", "hf_assets_path", str)
    preset = _FLAVORS.get(((name or "").lower(), (flavor or "").lower()))
    if preset:
        model["name"] = preset
    elif assets and (Path(assets).expanduser() / "config.json").is_file():
        model["name"] = assets
    elif name or flavor:
        notes.append(f"model {name}/{flavor} is not a trainmem preset: give the model with --model")


def _parallel(get, par: dict, notes: list[str], where: str) -> None:
    degrees = {}
    for key in ("data_parallel_replicate_degree", "data_parallel_shard_degree", "tensor_parallel_degree",
                "pipeline_parallel_degree", "context_parallel_degree", "expert_parallel_degree"):
        value = get("parallelism", key, int)
        if value is not None:
            if value == 0 or value < -1 or (value == -1 and key != "data_parallel_shard_degree"):
                raise ConfigError(f"{where}: [parallelism] {key}={value} must be positive"
                                  + (" or -1" if key == "data_parallel_shard_degree" else ""))
            degrees[key] = value
    replicate = degrees.get("data_parallel_replicate_degree", 1)
    shard = degrees.get("data_parallel_shard_degree", 1)
    if shard == -1:
        notes.append("data_parallel_shard_degree = -1 (all remaining ranks): give --dp to set the sharding size")
    elif shard > 1:
        par.update(dp=replicate * shard, fsdp="hybrid" if replicate > 1 else "full")
        if replicate > 1:
            par["fsdp_group"] = shard
    elif replicate > 1:
        par["dp"] = replicate
    for key, field in (("tensor_parallel_degree", "tp"), ("pipeline_parallel_degree", "pp"),
                       ("context_parallel_degree", "cp"), ("expert_parallel_degree", "ep")):
        if key in degrees:
            par[field] = degrees[key]
    if par.get("tp", 1) > 1:
        par["sp"] = True
    schedule = get("parallelism", "pipeline_parallel_schedule", str)
    if schedule is not None:
        mapped = _SCHEDULES.get(schedule.lower())
        if mapped is None:
            raise ConfigError(f"{where}: pipeline_parallel_schedule={schedule!r} is not one of "
                              f"GPipe, 1F1B, Interleaved1F1B, LoopedBFS, InterleavedZeroBubble, ZBVZeroBubble")
        par["schedule"] = mapped
        if mapped == "interleaved":
            par["virtual_stages"] = 2
            notes.append("interleaved schedule: modelled with 2 stages per rank (torchtitan's default)")


def _checkpoint(get, impl: dict, notes: list[str], where: str) -> None:
    mode = get("activation_checkpoint", "mode", str)
    if mode is None:
        return
    if mode in ("none", "full"):
        impl["recompute"] = mode
    elif mode == "selective":
        option = get("activation_checkpoint", "selective_ac_option", (str, int))
        option = "op" if option is None else str(option)
        if option == "op":
            impl["recompute"] = "selective"
        elif option.isdigit() and int(option) > 0:
            impl.update(recompute="every-k", recompute_every=int(option))
        else:
            raise ConfigError(f"{where}: [activation_checkpoint] selective_ac_option={option!r} must be 'op' "
                              f"or a positive integer")
    else:
        raise ConfigError(f"{where}: [activation_checkpoint] mode={mode!r} must be none, selective or full")
