"""A DeepSpeed config JSON -> step and parallel overrides.

Read: ``zero_optimization.stage``, ``zero_optimization.offload_optimizer.device`` and
``offload_param.device`` (``cpu``/``nvme`` -> offloaded), ``train_micro_batch_size_per_gpu``,
``gradient_accumulation_steps``, ``train_batch_size`` (with the two before it, gives the data-parallel
size), ``bf16.enabled`` / ``fp16.enabled`` (-> ``mixed-bf16`` / ``mixed-fp16``: DeepSpeed keeps fp32
master weights and optimizer states; neither -> ``fp32``) and ``optimizer.type`` (with
``optimizer.params`` for torch's SGD, RMSprop and Adagrad); a type whose memory is not modelled
(Lamb, 1-bit Adam/Lamb, 0/1 Adam, Muon, any other) is an error naming it.

``"auto"`` (the Hugging Face Trainer's placeholder) leaves a value to the command line and defaults.
Every other key is ignored: a DeepSpeed config holds much that does not change memory.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from trainmem.errors import ConfigError
from trainmem.inputs._common import answer, load_json, positive_int, typed

__all__ = ["read_deepspeed"]

#: ``optimizer.type`` (lower-cased, ``_`` dropped) -> (trainmem optimizer, torch class whose settings
#: matter, note). DeepSpeed's own names (``deepspeed/runtime/config.py`` ``DEEPSPEED_OPTIMIZERS``) build
#: its classes (``engine.py`` ``_configure_basic_optimizer``: FusedAdam / DeepSpeedCPUAdam, FusedLion /
#: DeepSpeedCPULion, torch's Adagrad / DeepSpeedCPUAdagrad, mup's MuAdam/MuAdamW/MuSGD over torch's
#: classes); any other type is ``getattr(torch.optim, type)`` built with ``optimizer.params``.
_OPTIMIZERS: dict[str, tuple[str, str, str]] = {
    "adam": ("adam", "", ""), "adamw": ("adamw", "", ""), "fusedadam": ("adamw", "", ""),
    "cpuadam": ("adamw", "", ""), "deepspeedcpuadam": ("adamw", "", ""), "adafactor": ("adafactor", "", ""),
    "muadam": ("adam", "", ""), "muadamw": ("adamw", "", ""),
    "sgd": ("sgd", "SGD", ""), "musgd": ("sgd", "SGD", ""), "rmsprop": ("rmsprop", "RMSprop", ""),
    "adagrad": ("adagrad", "Adagrad", ""),
    "lion": ("lion32bit", "", "DeepSpeed's FusedLion keeps one fp32 momentum per parameter, estimated as "
                              "lion32bit (the same bytes, updated in place)"),
}
#: DeepSpeed optimizers whose memory is not modelled -> why (refused, not estimated as Adam)
_UNMODELLED = {
    "lamb": "DeepSpeed's FusedLamb is not modelled",
    **dict.fromkeys(("onebitadam", "zerooneadam", "onebitlamb"),
                    "1-bit compression keeps error-feedback buffers that are not modelled"),
    "muon": "Muon orthogonalizes each matrix's update (Newton-Schulz temporaries), not modelled",
}
_OFFLOAD_DEVICES = ("cpu", "nvme")


def read_deepspeed(path: str | Path) -> dict:
    """Overrides from a DeepSpeed config file (see the module docstring)."""
    return deepspeed_overrides(load_json(path, "DeepSpeed config"), str(path))


def deepspeed_overrides(cfg: dict, where: str = "deepspeed") -> dict:
    raw: dict[str, Any] = {}
    step: dict[str, Any] = {}
    par: dict[str, Any] = {}
    notes: list[str] = []

    def get(*keys: str) -> Any:
        node: Any = cfg
        for i, k in enumerate(keys):
            if not isinstance(node, dict):
                raise ConfigError(f"{where}: {'.'.join(keys[:i])} must be an object, got {node!r:.40}")
            if k not in node:
                return None
            node = node[k]
        if node == "auto":
            notes.append(f"{'.'.join(keys)} is \"auto\": left to the command line and defaults")
            raw[".".join(keys)] = node
            return None
        if node is not None:
            raw[".".join(keys)] = node
        return node

    micro = get("train_micro_batch_size_per_gpu")
    if micro is not None:
        step["batch"] = positive_int(where, "train_micro_batch_size_per_gpu", micro)
    accum = get("gradient_accumulation_steps")
    if accum is not None:
        step["grad_accum"] = positive_int(where, "gradient_accumulation_steps", accum)
    total = get("train_batch_size")
    if total is not None:
        positive_int(where, "train_batch_size", total)
        if micro is not None:
            per_step = micro * (accum or 1)
            if total % per_step:
                raise ConfigError(f"{where}: train_batch_size={total} is not a multiple of "
                                  f"train_micro_batch_size_per_gpu={micro} × gradient_accumulation_steps={accum or 1}")
            par["dp"] = total // per_step

    stage = get("zero_optimization", "stage")
    if stage is not None:
        typed(where, "zero_optimization.stage", stage, int)
        if stage not in (0, 1, 2, 3):
            raise ConfigError(f"{where}: zero_optimization.stage={stage} must be 0, 1, 2 or 3")
        par["zero"] = stage
    offload = []
    for key, what in (("offload_optimizer", "optimizer"), ("offload_param", "params")):
        device = get("zero_optimization", key, "device")
        if device is None:
            continue
        typed(where, f"zero_optimization.{key}.device", device, str)
        if device.lower() in _OFFLOAD_DEVICES:
            offload.append(what)
        elif device.lower() != "none":
            raise ConfigError(f"{where}: zero_optimization.{key}.device={device!r} must be cpu, nvme or none")
    if offload:
        par["offload"] = tuple(offload)

    bf16 = _enabled(where, "bf16", get("bf16", "enabled"))
    fp16 = _enabled(where, "fp16", get("fp16", "enabled"))
    if bf16 and fp16:
        raise ConfigError(f"{where}: bf16.enabled and fp16.enabled are both true")
    if bf16:
        step["precision"] = "mixed-bf16"
    elif fp16:
        step["precision"] = "mixed-fp16"
    elif "auto" not in (raw.get("bf16.enabled"), raw.get("fp16.enabled")):
        step["precision"] = "fp32"  # DeepSpeed trains in fp32 unless told otherwise

    opt = get("optimizer", "type")
    if opt is not None:
        step["optimizer"] = _optimizer(where, typed(where, "optimizer.type", opt, str), get, notes)

    if get("activation_checkpointing", "cpu_checkpointing"):
        notes.append("activation_checkpointing.cpu_checkpointing is not modelled")
    return answer("deepspeed", where, raw, {"step": step, "parallel": par}, notes)


def _optimizer(where: str, opt: str, get, notes: list[str]) -> str:
    from trainmem.errors import UnsupportedError
    from trainmem.integrations.read import check_torch_settings

    key = opt.lower().replace("_", "")
    if key in _UNMODELLED:
        raise ConfigError(f"{where}: optimizer.type={opt!r} is not modelled: {_UNMODELLED[key]}")
    if key not in _OPTIMIZERS:
        raise ConfigError(f"{where}: optimizer.type={opt!r} is not modelled (modelled: {', '.join(_OPTIMIZERS)})")
    name, torch_class, note = _OPTIMIZERS[key]
    if torch_class:  # torch's SGD, RMSprop, Adagrad: weight decay, nesterov, RMSprop momentum add tensors
        params = get("optimizer", "params") or {}
        if not isinstance(params, dict):
            raise ConfigError(f"{where}: optimizer.params must be an object, got {params!r:.40}")
        settings = {k: v for k, v in params.items() if v != "auto"}
        try:
            check_torch_settings(torch_class, settings, f"optimizer.type={opt!r}")
        except UnsupportedError as e:
            raise ConfigError(f"{where}: {e}") from None
        if torch_class == "SGD" and settings.get("momentum"):  # a momentum buffer per parameter
            name = "sgd-momentum"
    if note:
        notes.append(f"optimizer.type={opt!r}: {note}")
    return name


def _enabled(where: str, key: str, value: Any) -> bool | None:
    if value is None:
        return None
    return typed(where, f"{key}.enabled", value, bool)
