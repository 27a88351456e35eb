"""A torchtitan job config TOML -> overrides, read the way torchtitan runs it.

Every key is checked against torchtitan's own code, at the last version that read TOML files
(pytorch/torchtitan 238fa99, before the config refactor #2386); the comments name the file and
function. A key the file leaves out takes torchtitan's default (``Training``, ``Parallelism``,
``ActivationCheckpoint`` and ``Optimizer`` in ``torchtitan/config/job_config.py``), and a note
lists which defaults were used.

* ``[model] name/flavor`` (Llama 2/3 flavors map to trainmem presets) or ``hf_assets_path`` (a
  folder holding config.json).
* ``[training] local_batch_size`` (older: ``batch_size``), ``seq_len``, ``global_batch_size``
  (gradient accumulation), ``dtype`` and ``mixed_precision_param``: with FSDP (a shard degree or
  context parallelism above 1) ``bfloat16`` is ``fully_shard``'s MixedPrecisionPolicy
  (``fsdp-bf16``); under DDP or on one device it is ``torch.autocast`` (``amp-bf16``); with TP or
  PP and no FSDP torchtitan turns mixed precision off (``fp32``).
* ``[parallelism]`` degrees (``tp > 1`` sets ``sp``: torchtitan always applies sequence
  parallelism with tensor parallelism; ``disable_loss_parallel`` -> ``loss_parallel``),
  ``fsdp_reshard_after_forward`` (``default`` is off under
  pipeline parallelism), the pipeline schedule, and the micro-batches: ``local_batch_size`` is
  split into micro-batches of ``pipeline_parallel_microbatch_size`` (older configs: into
  ``pipeline_parallel_microbatches``, by default the number of stages).
* ``[activation_checkpoint] mode`` and ``selective_ac_option`` (``op`` -> op, an integer
  k -> every k-th block); ``[optimizer] name``; ``[training] enable_cpu_offload`` (with FSDP:
  parameters and optimizer on the host); ``[compile] enable`` with ``components``
  (``model`` -> each block compiled, ``loss`` too -> ``--compile --compile-scope block``/``block-loss``:
  ``inputs/compile_keys.py``).
* ``[model] converters = ["float8"]`` with ``[float8]`` (newer: ``quantize.linear.float8`` with
  ``[quantize.linear.float8]``): ``recipe_name`` (none: tensorwise), ``enable_fsdp_float8_all_gather``
  (under FSDP), ``filter_fqns`` (``output`` is the modelled one) -> ``--float8``.

Other tables and keys (job, metrics, checkpoint, ...) do not change memory and are ignored.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from trainmem.errors import ConfigError
from trainmem.inputs._common import answer, load_toml, positive_int, table, typed
from trainmem.inputs.compile_keys import torchtitan_compile

__all__ = ["read_torchtitan"]

_FLAVORS = {
    ("llama3", "8b"): "llama-3-8b", ("llama3", "70b"): "llama-3-70b", ("llama3", "405b"): "llama-3.1-405b",
    ("llama2", "7b"): "llama-2-7b", ("llama2", "13b"): "llama-2-13b", ("llama2", "70b"): "llama-2-70b",
}
_SCHEDULES = {"gpipe": "gpipe", "1f1b": "1f1b", "interleaved1f1b": "interleaved", "loopedbfs": "interleaved",
              "interleavedzerobubble": "zero-bubble", "zbvzerobubble": "zero-bubble"}
_OPTIMIZERS = {"adamw": "adamw", "adam": "adam", "sgd": "sgd"}

#: torchtitan's defaults for the keys that change memory (torchtitan/config/job_config.py).
DEFAULTS: dict[str, Any] = {
    "training.local_batch_size": 8, "training.seq_len": 2048, "training.global_batch_size": -1,
    "training.dtype": "float32", "training.mixed_precision_param": "bfloat16",
    "parallelism.data_parallel_shard_degree": -1, "parallelism.fsdp_reshard_after_forward": "default",
    "parallelism.pipeline_parallel_microbatch_size": 1, "parallelism.pipeline_parallel_schedule": "1F1B",
    "activation_checkpoint.mode": "selective", "activation_checkpoint.selective_ac_option": "2",
    "optimizer.name": "AdamW",
}
_DEGREES = ("data_parallel_replicate_degree", "data_parallel_shard_degree", "tensor_parallel_degree",
            "pipeline_parallel_degree", "context_parallel_degree", "expert_parallel_degree")


def read_torchtitan(path: str | Path) -> dict:
    """Overrides from a torchtitan job config file (see the module docstring)."""
    return torchtitan_overrides(load_toml(path, "torchtitan config"), str(path))


def torchtitan_overrides(cfg: dict, where: str = "torchtitan") -> dict:
    raw: dict[str, Any] = {}
    notes: list[str] = []
    defaulted: list[str] = []
    sec: dict[str, dict[str, Any]] = {"model": {}, "step": {}, "impl": {}, "parallel": {}}

    def get(section: str, key: str, kind, *, default: bool = True, also: str = "") -> Any:
        """The file's value (under ``section``, else the older ``also``), else torchtitan's
        default (noted) unless ``default`` is false, else None."""
        for sec_name in (section, also) if also else (section,):
            value = table(cfg, sec_name, where).get(key)
            if value is not None:
                raw[f"{sec_name}.{key}"] = value
                return typed(where, f"[{sec_name}] {key}", value, kind)
        name = f"{section}.{key}"
        if default and name in DEFAULTS:
            defaulted.append(f"{key}={DEFAULTS[name]!r}")
            return DEFAULTS[name]
        return None

    _model(get, sec["model"], notes)
    step, par = sec["step"], sec["parallel"]
    old_batch = get("training", "batch_size", int, default=False)  # renamed local_batch_size in 2025-06
    local_batch = positive_int(where, "[training] local_batch_size",
                               get("training", "local_batch_size", int, default=old_batch is None) or old_batch)
    step["seq"] = positive_int(where, "[training] seq_len", get("training", "seq_len", int))
    opt = get("optimizer", "name", str)
    if opt.lower() in _OPTIMIZERS:
        step["optimizer"] = _OPTIMIZERS[opt.lower()]
    else:
        notes.append(f"[optimizer] name={opt!r} is not modelled")

    dims = _parallel(get, par, notes, where)
    step["precision"] = _precision(get, dims, notes, where)
    micro = _pipeline(get, par, dims, local_batch, old_batch is not None, notes, where)
    step["batch"] = micro
    accum = _grad_accum(get, dims, local_batch, notes, where)
    if accum is not None:
        step["grad_accum"] = accum
    _checkpoint(get, sec["impl"], notes, where)
    _host(get, par, dims, notes)
    torchtitan_compile(get, sec["impl"], notes, where)
    _float8(cfg, raw, sec["impl"], dims, notes, where)
    if defaulted:
        notes.append("torchtitan's defaults for keys the file leaves out: " + ", ".join(defaulted))
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


def _parallel(get, par: dict, notes: list[str], where: str) -> dict[str, int]:
    """Degrees (``shard`` may be -1: the ranks left over) and the FSDP settings torchtitan derives."""
    degrees, given = {}, set()
    for key in _DEGREES:
        value = get("parallelism", key, int, default=False)
        if value is not None:
            given.add(key)
        else:  # only the shard degree has a default other than 1
            value = get("parallelism", key, int) if key == "data_parallel_shard_degree" else 1
        if value == 0 or value < -1 or (value == -1 and key != "data_parallel_shard_degree"):
            raise ConfigError(f"{where}: [parallelism] {key}={value} must be positive"
                              + (" or -1" if key == "data_parallel_shard_degree" else ""))
        degrees[key] = value
    replicate, shard = degrees["data_parallel_replicate_degree"], degrees["data_parallel_shard_degree"]
    d = {"replicate": replicate, "shard": shard, "tp": degrees["tensor_parallel_degree"],
         "pp": degrees["pipeline_parallel_degree"], "cp": degrees["context_parallel_degree"]}
    # torchtitan/distributed/parallel_dims.py, ParallelDims.fsdp_enabled: dp_shard > 1 or cp > 1
    # (_validate resolves dp_shard = -1 to the ranks left after the other degrees)
    d["fsdp"] = int(shard == -1 or shard > 1 or d["cp"] > 1)
    if shard == -1:
        notes.append("data_parallel_shard_degree = -1: FSDP over the ranks the other degrees leave; give --dp "
                     "(and --fsdp-group under HSDP) for how many; with none left torchtitan does not shard, "
                     "and autocasts (amp-bf16) instead of fsdp-bf16")
    elif shard > 1:
        par.update(dp=replicate * shard)
    elif replicate > 1:
        par["dp"] = replicate
    if d["fsdp"]:
        par["fsdp"] = "hybrid" if replicate > 1 else "full"
        if replicate > 1 and shard != -1:
            par["fsdp_group"] = shard * d["cp"]  # torchtitan's "fsdp" mesh is dp_shard × cp
    for key, field in (("tensor_parallel_degree", "tp"), ("pipeline_parallel_degree", "pp"),
                       ("context_parallel_degree", "cp"), ("expert_parallel_degree", "ep")):
        if key in given:
            par[field] = degrees[key]
    if d["tp"] > 1:
        par["sp"] = True
        # torchtitan/train.py, Trainer.__init__: loss_parallel_enabled = tp_enabled and not
        # disable_loss_parallel (job_config.py, Parallelism: default False); parallelize.py, apply_tp:
        # the output layer's logits stay Shard(-1) for it, else are gathered (estimate/loss_parallel.py)
        if get("parallelism", "disable_loss_parallel", bool, default=False):
            par["loss_parallel"] = False
    if d["fsdp"]:
        par["reshard_after_forward"] = _reshard(get, d["pp"] > 1, where)
        # parallelize.py, apply_fsdp: tok_embeddings and [norm, output] are fully_shard-ed on their own
        par["fsdp_units"] = "blocks+embed+head"
    schedule = get("parallelism", "pipeline_parallel_schedule", str, default=d["pp"] > 1)
    if schedule is not None:
        mapped = _SCHEDULES.get(schedule.lower())
        if mapped is None:
            raise ConfigError(f"{where}: pipeline_parallel_schedule={schedule!r} is not one of "
                              f"GPipe, 1F1B, Interleaved1F1B, LoopedBFS, InterleavedZeroBubble, ZBVZeroBubble")
        par["schedule"] = mapped
        if mapped == "interleaved":
            par["virtual_stages"] = 2
            notes.append("interleaved schedule: modelled with 2 stages per rank (torchtitan's default)")
    return d


def _reshard(get, pp_enabled: bool, where: str) -> bool:
    # torchtitan/models/llama3/infra/parallelize.py, apply_fsdp: "always" -> True, "never" -> False,
    # "default" -> not pp_enabled (no per-micro-batch all-gathers under pipelining)
    policy = get("parallelism", "fsdp_reshard_after_forward", str)
    choices = {"always": True, "never": False, "default": not pp_enabled}
    if policy not in choices:
        raise ConfigError(f"{where}: [parallelism] fsdp_reshard_after_forward={policy!r} must be default, "
                          f"always or never")
    return choices[policy]


def _precision(get, d: dict[str, int], notes: list[str], where: str) -> str:
    # job_config.py, Training.dtype: "bfloat16" keeps parameters, gradients and states in bf16
    dtype = get("training", "dtype", str)
    if dtype not in ("float32", "bfloat16"):
        raise ConfigError(f"{where}: [training] dtype={dtype!r} must be float32 or bfloat16")
    mp = get("training", "mixed_precision_param", str, also="parallelism")  # older configs: [parallelism]
    if mp not in ("bfloat16", "float32"):
        raise ConfigError(f"{where}: mixed_precision_param={mp!r} must be bfloat16 or float32")
    if dtype == "bfloat16":
        return "bf16"
    if mp == "float32":
        return "fp32"
    if d["fsdp"]:
        # parallelize.py, apply_fsdp: MixedPrecisionPolicy(param_dtype=mixed_precision_param,
        # reduce_dtype=mixed_precision_reduce (float32)), and no autocast
        # (torchtitan/distributed/utils.py, maybe_enable_amp: "handled by fully_shard")
        return "fsdp-bf16"
    if d["tp"] > 1 or d["pp"] > 1:
        # utils.py, maybe_enable_amp: with TP or PP but no FSDP, mixed precision is disabled
        notes.append("mixed_precision_param='bfloat16' with TP or PP and no FSDP: torchtitan disables mixed "
                     "precision, so the step is fp32")
        return "fp32"
    return "amp-bf16"  # maybe_enable_amp: DDP or one device -> torch.autocast(dtype=bfloat16)


def _pipeline(get, par: dict, d: dict[str, int], local_batch: int, old_config: bool, notes: list[str],
              where: str) -> int:
    """The micro-batch size one forward sees; sets ``par['microbatches']`` under pipelining."""
    if d["pp"] == 1:
        return local_batch
    count = get("parallelism", "pipeline_parallel_microbatches", int, default=False)
    size = get("parallelism", "pipeline_parallel_microbatch_size", int, default=not old_config and count is None)
    if count is None and size is None:
        # torchtitan before #1073 (2025-04): n_microbatches defaults to the number of stages
        # (torchtitan/distributed/pipeline.py, build_pipeline_schedule)
        count = d["pp"] * par.get("virtual_stages", 1)
        notes.append(f"pipeline micro-batches: {count}, the number of stages (torchtitan's default for configs "
                     f"with batch_size; newer ones split local_batch_size into micro-batches of 1)")
    if count is not None:
        positive_int(where, "[parallelism] pipeline_parallel_microbatches", count)
        if local_batch % count:
            raise ConfigError(f"{where}: [training] batch_size={local_batch} must be divisible by "
                              f"pipeline_parallel_microbatches={count}")
        size = local_batch // count
    else:
        # torchtitan/distributed/pipeline_parallel.py, build_pipeline_schedule:
        # n_microbatches = local_batch_size // pipeline_parallel_microbatch_size
        positive_int(where, "[parallelism] pipeline_parallel_microbatch_size", size)
        if local_batch % size:
            raise ConfigError(f"{where}: [training] local_batch_size={local_batch} must be divisible by "
                              f"pipeline_parallel_microbatch_size={size}")
    par["microbatches"] = local_batch // size
    return size


def _grad_accum(get, d: dict[str, int], local_batch: int, notes: list[str], where: str) -> int | None:
    # torchtitan/train.py, Trainer.__init__: gradient_accumulation_steps =
    # global_batch_size // (local_batch_size * batch_degree), batch_degree = dp_replicate * dp_shard
    global_batch = get("training", "global_batch_size", int)
    if global_batch < 0:
        return 1
    if global_batch == 0:
        raise ConfigError(f"{where}: [training] global_batch_size=0 must be positive or -1")
    if d["shard"] == -1:
        notes.append(f"global_batch_size={global_batch}: gradient accumulation depends on the data-parallel "
                     f"degree (data_parallel_shard_degree = -1); give --grad-accum")
        return None
    per_step = local_batch * d["replicate"] * d["shard"]
    if global_batch % per_step:
        raise ConfigError(f"{where}: [training] global_batch_size={global_batch} must be a multiple of "
                          f"local_batch_size × data-parallel degree = {per_step}")
    return global_batch // per_step


def _host(get, par: dict, d: dict[str, int], notes: list[str]) -> None:
    # parallelize.py, apply_fsdp(cpu_offload=training.enable_cpu_offload): FSDP's CPUOffloadPolicy
    # keeps parameter and gradient shards on the host, and the optimizer steps there (estimate/fsdp_offload.py)
    if get("training", "enable_cpu_offload", bool, default=False) and d["fsdp"]:
        par["offload"] = ("optimizer", "params")
        notes.append("enable_cpu_offload: FSDP2's CPUOffloadPolicy; sharded parameters, gradients and optimizer "
                     "states in pinned host memory (the host figure)")


_FLOAT8_CONVERTERS = ("float8", "quantize.linear.float8")  # the table the converter reads is named alike


def _float8(cfg: dict, raw: dict, impl: dict, d: dict[str, int], notes: list[str], where: str) -> None:
    """``[model] converters`` with ``float8`` (its ``[float8]`` table) or ``quantize.linear.float8``
    (``[quantize.linear.float8]``), read as torchtitan's ``Float8Converter.__init__``
    (torchtitan/components/quantization/float8.py at 238fa99): no ``recipe_name`` is tensorwise
    (``Float8LinearConfig()``), whose fp8 all-gather runs only under FSDP (``dp_shard_enabled``); a
    recipe with ``enable_fsdp_float8_all_gather`` is refused as torchtitan asserts."""
    converters = table(cfg, "model", where).get("converters", [])
    if isinstance(converters, str):
        converters = [c.strip() for c in converters.split(",")]
    name = next((c for c in typed(where, "[model] converters", converters, list) if c in _FLOAT8_CONVERTERS), None)
    if name is None:
        linear = cfg.get("quantize", {}).get("linear", {}) if isinstance(cfg.get("quantize"), dict) else {}
        if "float8" in cfg or isinstance(linear, dict) and "float8" in linear:  # a table nothing reads
            notes.append("a [float8] table without \"float8\" in [model] converters: torchtitan converts no linear "
                         "(build_model_converters reads the converters list), so no Float8 is estimated")
        return
    raw["model.converters"] = converters
    section = cfg
    for part in name.split("."):
        section = table(section, part, where)

    def key(k: str, kind, default):
        if section.get(k) is None:
            return default
        raw[f"{name}.{k}"] = section[k]
        return typed(where, f"[{name}] {k}", section[k], kind)

    recipe = key("recipe_name", str, None)
    all_gather = key("enable_fsdp_float8_all_gather", bool, False)
    filters = key("filter_fqns", (list, str), [])
    filters = [f.strip() for f in filters.split(",")] if isinstance(filters, str) else filters
    if recipe is not None and all_gather:
        raise ConfigError(f"{where}: [{name}] enable_fsdp_float8_all_gather = true with recipe_name={recipe!r}: "
                          "torchtitan refuses the pair (the fp8 all-gather is the tensorwise default's)")
    if recipe not in (None, "tensorwise", "rowwise"):
        notes.append(f"[{name}] recipe_name={recipe!r} is not modelled: estimated without Float8")
        return
    impl["float8"] = recipe or "tensorwise"
    if all_gather and d["fsdp"]:
        impl["float8_all_gather"] = True
    elif all_gather:
        notes.append(f"[{name}] enable_fsdp_float8_all_gather: no FSDP here, so torchtitan does not enable it")
    if "output" not in filters:
        notes.append(f"[{name}] filter_fqns does not name 'output': torchtitan converts the output layer too; "
                     "the estimate keeps it in high precision")
    others = [f for f in filters if f != "output"]
    if others:
        notes.append(f"[{name}] filter_fqns {others}: not modelled (only the output layer is left out)")


def _checkpoint(get, impl: dict, notes: list[str], where: str) -> None:
    # job_config.py, ActivationCheckpoint: mode "selective", selective_ac_option "2" (every 2nd block)
    mode = get("activation_checkpoint", "mode", str)
    if mode in ("none", "full"):
        impl["recompute"] = mode
    elif mode == "selective":
        option = str(get("activation_checkpoint", "selective_ac_option", (str, int)))
        if option == "op":  # op-level SAC with torchtitan's policy: ImplSpec recompute "op"
            impl["recompute"] = "op"
        elif option.isdigit():  # _apply_layer_sac: `not ac_freq or count % ac_freq == 0`, 0 wraps every block
            every = int(option)
            if every in (0, 1):
                impl["recompute"] = "full"
            else:
                impl.update(recompute="every-k", recompute_every=every)
        else:
            raise ConfigError(f"{where}: [activation_checkpoint] selective_ac_option={option!r} must be 'op' "
                              f"or a non-negative integer")
    else:
        raise ConfigError(f"{where}: [activation_checkpoint] mode={mode!r} must be none, selective or full "
                          f"(memory_budget is left to torch.compile's partitioner and is not modelled)")
