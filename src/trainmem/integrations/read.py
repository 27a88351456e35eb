"""Read trainmem's specs off live PyTorch objects: a (peft-wrapped) Hugging Face model and an optimizer.

Each reader returns the spec value and the notes that say where it came from or what is not
modelled; nothing is defaulted silently. Unmodelled inputs that would make the estimate wrong
(an unknown optimizer, a non-LoRA adapter) raise :class:`~trainmem.errors.UnsupportedError`.

Known limitations:
  - Frozen parameters outside peft (``requires_grad=False`` set by hand) are noted, not modelled.
  - Only peft's LoRA adapters are read (not IA3, prefix tuning, ...).
"""

from __future__ import annotations

from dataclasses import dataclass

from trainmem.errors import ConfigError, UnsupportedError
from trainmem.estimate.optimizer_step import DEFAULT_IMPL
from trainmem.specs import ModelSpec
from trainmem.specs.finetune import FinetuneSpec

__all__ = ["Read", "base_model", "model_spec_of", "precision_of", "recompute_of", "attention_of", "device_of",
           "finetune_of", "optimizer_of", "optimizer_key", "trainer_optim", "trainer_optim_of", "OPTIMIZER_CLASSES",
           "TRAINER_OPTIMS", "UNMODELLED_TRAINER_OPTIMS", "check_torch_settings"]

_DTYPE_NAME = {"torch.float32": "float32", "torch.bfloat16": "bfloat16", "torch.float16": "float16"}

#: transformers ``config._attn_implementation`` -> trainmem attention kernel.
_ATTENTION = {"eager": "eager", "sdpa": "sdpa", "flash_attention_2": "flash", "flash_attention_3": "flash"}

#: optimizer class -> (trainmem optimizer, note): torch.optim's and transformers' Adafactor by class
#: name; bitsandbytes' and torchao's qualified by their package (:func:`optimizer_key`), since
#: ``bitsandbytes.optim.AdamW8bit`` and ``torchao.optim.AdamW8bit`` share a name.
OPTIMIZER_CLASSES: dict[str, tuple[str, str]] = {
    "AdamW": ("adamw", ""), "Adam": ("adam", ""), "Adafactor": ("adafactor", ""),
    "RMSprop": ("rmsprop", ""), "Adagrad": ("adagrad", ""),
    "bitsandbytes.AdamW8bit": ("adamw8bit", ""), "bitsandbytes.Adam8bit": ("adam8bit", ""),
    "bitsandbytes.PagedAdamW8bit": ("paged-adamw8bit", ""), "bitsandbytes.PagedAdamW32bit": ("paged-adamw32bit", ""),
    "bitsandbytes.Lion32bit": ("lion32bit", ""), "bitsandbytes.Lion8bit": ("lion8bit", ""),
    "bitsandbytes.PagedLion32bit": ("paged-lion32bit", ""), "bitsandbytes.PagedLion8bit": ("paged-lion8bit", ""),
    "bitsandbytes.RMSprop32bit": ("rmsprop32bit", ""), "bitsandbytes.RMSprop8bit": ("rmsprop8bit", ""),
    "bitsandbytes.AdEMAMix32bit": ("ademamix", ""), "bitsandbytes.AdEMAMix8bit": ("ademamix8bit", ""),
    "torchao.AdamW8bit": ("torchao-adamw8bit", ""), "torchao.AdamW4bit": ("torchao-adamw4bit", ""),
    "torchao.AdamW4bit(block_size=256)": ("torchao-adamw4bit-block256", ""),
}

#: torch.optim classes, whose ``defaults`` hold ``foreach``/``fused`` (None: torch chooses).
#: Classes of the same name without those keys (bitsandbytes', transformers' Adafactor) have one
#: implementation.
_TORCH_OPTIMIZERS = ("AdamW", "Adam", "SGD", "Adafactor", "RMSprop", "Adagrad")

#: TrainingArguments ``optim`` -> optimizer class name above, for a run whose optimizer is not
#: built yet (transformers 5.24 ``trainer_optimizer.py``'s ``_OPTIMIZER_HANDLERS``;
#: ``_get_bitsandbytes_optimizer`` builds ``AdamW``, ``Lion``, ``RMSprop`` or ``AdEMAMix`` with
#: ``optim_bits=8 if "8bit" in optim else 32`` and, but for RMSprop, ``is_paged="paged" in optim``;
#: ``_get_torchao_optimizer`` ``torchao.optim.AdamW4bit``/``AdamW8bit``; ``_get_sgd``,
#: ``_get_rmsprop``, ``_get_adagrad`` torch's classes with what ``optim_args`` gives).
TRAINER_OPTIMS = {
    "adamw_torch": "AdamW", "adamw_torch_fused": "AdamW", "adafactor": "Adafactor", "sgd": "SGD",
    "rmsprop": "RMSprop", "adagrad": "Adagrad",
    "adamw_bnb_8bit": "bitsandbytes.AdamW8bit", "adamw_8bit": "bitsandbytes.AdamW8bit",
    "paged_adamw_8bit": "bitsandbytes.PagedAdamW8bit", "paged_adamw_32bit": "bitsandbytes.PagedAdamW32bit",
    "lion_32bit": "bitsandbytes.Lion32bit", "lion_8bit": "bitsandbytes.Lion8bit",
    "paged_lion_32bit": "bitsandbytes.PagedLion32bit", "paged_lion_8bit": "bitsandbytes.PagedLion8bit",
    "rmsprop_bnb": "bitsandbytes.RMSprop32bit", "rmsprop_bnb_32bit": "bitsandbytes.RMSprop32bit",
    "rmsprop_bnb_8bit": "bitsandbytes.RMSprop8bit",
    "ademamix": "bitsandbytes.AdEMAMix32bit", "ademamix_8bit": "bitsandbytes.AdEMAMix8bit",
    # _get_torchao_optimizer passes block_size=optim_args.get("block_size", 256): 256 for both classes
    "adamw_torch_8bit": "torchao.AdamW8bit", "adamw_torch_4bit": "torchao.AdamW4bit(block_size=256)",
}

_LOW_RANK = "projects the gradients of optim_target_modules to rank-r subspaces ({}): projections and low-rank states"
#: the other ``OptimizerNames`` of transformers 5.24 -> what their memory depends on that trainmem does
#: not model (trainer_optimizer.py, the handler each is built by); they are refused, not estimated as AdamW
UNMODELLED_TRAINER_OPTIMS = {
    "adamw_torch_xla": "torch_xla's syncfree AdamW runs on XLA devices (trainmem models CUDA and CPU)",
    "adamw_torch_npu_fused": "torch_npu's NpuFusedAdamW runs on Ascend NPUs (trainmem models CUDA and CPU)",
    "adamw_anyprecision": "torchdistx's AnyPrecisionAdamW keeps its moments in the dtypes optim_args name, "
                          "with an optional Kahan compensation buffer",
    **dict.fromkeys(("paged_ademamix_32bit", "paged_ademamix_8bit"),
                    "bitsandbytes' paged AdEMAMix pages its two-momentum state1 through F.get_paged directly "
                    "(ademamix.py, _get_state_double_buffer), which the tracer does not follow"),
    **dict.fromkeys(("galore_adamw", "galore_adamw_8bit", "galore_adafactor"), _LOW_RANK.format("galore_torch")),
    **dict.fromkeys(("galore_adamw_layerwise", "galore_adamw_8bit_layerwise", "galore_adafactor_layerwise"),
                    _LOW_RANK.format("galore_torch") + ", one optimizer per parameter stepped in backward"),
    "apollo_adamw": _LOW_RANK.format("apollo_torch"),
    "apollo_adamw_layerwise": _LOW_RANK.format("apollo_torch") + ", one optimizer per parameter stepped in backward",
    **dict.fromkeys(("lomo", "adalomo"), "lomo_optim updates the weights inside backward"),
    "grokadamw": "grokadamw's GrokAdamW keeps states beyond Adam's two",
    **dict.fromkeys(("schedule_free_radam", "schedule_free_adamw", "schedule_free_sgd"),
                    "schedulefree's optimizers keep their own sequence of the weights (z) as a state"),
    "stable_adamw": "optimi's StableAdamW adds Kahan summation buffers for low-precision weights",
}


def trainer_optim(optim: str, optim_args: str | None, weight_decay: float = 0.0) -> tuple[str, dict]:
    """``(class key of OPTIMIZER_CLASSES or "SGD", the defaults it is built with)`` of a
    TrainingArguments ``optim`` and ``optim_args``, or UnsupportedError naming ``optim`` and the value
    for what trainmem does not model. ``weight_decay`` (the Trainer's decay group) matters to torch's
    SGD, RMSprop and Adagrad, which add it out of place (:func:`check_torch_settings`)."""
    optim = str(getattr(optim, "value", optim))
    if optim in UNMODELLED_TRAINER_OPTIMS:
        raise UnsupportedError(f"optim={optim!r} is not modelled: {UNMODELLED_TRAINER_OPTIMS[optim]}")
    if optim not in TRAINER_OPTIMS:
        raise UnsupportedError(f"optim={optim!r} is not a transformers optimizer name "
                               f"(modelled: {', '.join(TRAINER_OPTIMS)})")
    cls = TRAINER_OPTIMS[optim]
    kwargs = dict(kv.split("=", 1) for kv in (optim_args or "").replace(" ", "").split(",") if "=" in kv)
    if cls.startswith("torchao.") and "block_size" in kwargs:  # handed on as the string it was parsed into
        raise UnsupportedError(f"optim={optim!r} with optim_args block_size={kwargs['block_size']}: not modelled "
                               "(transformers passes it to torchao unconverted)")
    # Trainer.create_optimizer gives every parameter group its weight_decay (args.weight_decay or 0.0),
    # which overrides one that _get_sgd/_get_adagrad put in the defaults from optim_args
    defaults: dict = {"weight_decay": weight_decay}
    if cls in ("SGD", "RMSprop", "Adagrad"):  # _get_sgd, _get_rmsprop, _get_adagrad: floats and flags
        if "momentum" in kwargs:
            try:
                defaults["momentum"] = float(kwargs["momentum"])
            except ValueError:
                raise ConfigError(f"optim_args={optim_args!r}: momentum must be a number") from None
        for key in ("nesterov", "centered"):
            defaults[key] = kwargs.get(key, "false").lower() in ("true", "1", "yes")
    if cls in _TORCH_OPTIMIZERS and cls != "Adafactor":  # built with fused=True or neither: torch chooses
        defaults.update(foreach=None, fused=optim == "adamw_torch_fused" or None)
    check_torch_settings(cls, defaults, f"optim={optim!r}")
    return cls, defaults


def check_torch_settings(cls: str, settings: dict, what: str) -> None:
    """UnsupportedError for the settings of torch's SGD, RMSprop and Adagrad that make temporaries or
    states trainmem does not model: weight decay (``grad = grad.add(param, alpha=weight_decay)``, one
    gradient-sized tensor, or ``_foreach_add``: all of them), nesterov (``grad.add(buf)``), ``maximize``
    (``-grad``), RMSprop's momentum and centered (``momentum_buffer``, ``grad_avg``); Adam's and AdamW's
    ``amsgrad`` (a ``max_exp_avg_sq`` state, torch/optim/adam.py ``_init_group``) and ``maximize``
    (``_foreach_neg(grads)``, a gradient-sized copy per tensor, ``_multi_tensor_adam``), and Adam's coupled weight
    decay (``_foreach_add(grads, params)``, out of place); AdamW's decoupled one is an in-place ``mul_`` and passes."""
    if cls in ("Adam", "AdamW"):
        unmodelled = {"amsgrad": settings.get("amsgrad", False), "maximize": settings.get("maximize", False)}
        if cls == "Adam":
            unmodelled["weight_decay"] = settings.get("weight_decay", 0)
    elif cls not in ("SGD", "RMSprop", "Adagrad"):
        return
    else:
        unmodelled = {"weight_decay": settings.get("weight_decay", 0), "nesterov": settings.get("nesterov", False),
                      "maximize": settings.get("maximize", False)}
    if cls == "RMSprop":
        unmodelled.update(momentum=settings.get("momentum", 0), centered=settings.get("centered", False))
    for key, value in unmodelled.items():
        if value:
            raise UnsupportedError(f"{what} with {key}={value!r}: torch's {cls} then holds "
                                   f"{'a state' if key in ('momentum', 'centered', 'amsgrad') else 'a gradient-sized temporary'} "
                                   f"per tensor that trainmem does not model")


def optimizer_key(optimizer) -> str:
    """The :data:`OPTIMIZER_CLASSES` key of a live optimizer: its class name, qualified by the
    package for bitsandbytes and torchao. bitsandbytes' generic classes (``AdamW(optim_bits=8,
    is_paged=True)``, what transformers builds) are named by what they run: ``args.optim_bits`` and
    ``is_paged`` (``bitsandbytes/optim/optimizer.py``, ``Optimizer8bit``/``Optimizer2State``)."""
    cls = type(optimizer)
    package = cls.__module__.partition(".")[0]
    if package == "bitsandbytes":
        if "AdEMAMix" in cls.__name__ and not any(c.__name__ == "AdEMAMix" for c in cls.__mro__):
            return f"bitsandbytes.{cls.__name__} (Adam's layout, not AdEMAMix's two momenta)"  # AdEMAMix32bit
        bits = getattr(getattr(optimizer, "args", None), "optim_bits", 32)
        stem = cls.__name__.removeprefix("Paged").removesuffix("8bit").removesuffix("32bit")
        return f"bitsandbytes.{'Paged' if getattr(optimizer, 'is_paged', False) else ''}{stem}{bits}bit"
    if package == "torchao":  # a block size other than the class's default is part of the name
        import inspect
        default = inspect.signature(cls.__init__).parameters.get("block_size")
        block = getattr(optimizer, "block_size", None)
        if default is not None and block is not None and block != default.default:
            return f"torchao.{cls.__name__}(block_size={block})"
        return f"torchao.{cls.__name__}"
    return cls.__name__


@dataclass(frozen=True)
class Read:
    """One value read off a live object, with what the reader wants the user to know."""

    value: object
    notes: tuple[str, ...] = ()


def _dtype(t) -> str:
    return _DTYPE_NAME.get(str(t), str(t).removeprefix("torch."))


def base_model(model):
    """The transformers model under a peft wrapper (``PeftModel.get_base_model``), or ``model``."""
    get = getattr(model, "get_base_model", None)
    return get() if callable(get) else model


def model_spec_of(model) -> ModelSpec:
    """The :class:`ModelSpec` of a transformers model, from its config (``config.to_dict()``)."""
    from trainmem.specs.loaders import spec_from_hf_config

    config = getattr(base_model(model), "config", None)
    if config is None or not hasattr(config, "to_dict"):
        raise UnsupportedError(f"{type(model).__name__} has no Hugging Face config: pass spec=ModelSpec(...)")
    cfg = config.to_dict()
    return spec_from_hf_config(cfg, name=str(cfg.get("_name_or_path") or cfg.get("model_type") or "model"))


def _params(model) -> list:
    return list(model.parameters())


def precision_of(model, *, amp: str | None) -> Read:
    """``amp``: ``"bf16"``/``"fp16"`` when the step runs under torch.autocast (the Trainer's
    ``bf16``/``fp16``), else None. Autocast over 16-bit weights is pure 16-bit."""
    dtypes = {_dtype(p.dtype) for p in _params(base_model(model)) if p.is_floating_point()}
    base = "float32" if "float32" in dtypes and len(dtypes) == 1 else None
    for name in ("bfloat16", "float16"):
        if name in dtypes:
            base = name
    if base is None:
        raise UnsupportedError(f"parameter dtypes {sorted(dtypes)} are not modelled (float32, bfloat16 or float16)")
    if base == "float32":
        return Read({"bf16": "amp-bf16", "fp16": "amp-fp16", None: "fp32"}[amp])
    pure = {"bfloat16": "bf16", "float16": "fp16"}[base]
    notes = (f"autocast {amp} over {base} weights is pure {pure}",) if amp and amp != pure else ()
    return Read(pure, notes)


def recompute_of(model) -> Read:
    """full / every-k / none, from the per-layer ``gradient_checkpointing`` flags transformers sets
    (``modeling_utils.PreTrainedModel._set_gradient_checkpointing``: layer i is checkpointed when
    ``i % every_n_layers == 0``)."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    flags = [bool(m.gradient_checkpointing) for m in base_model(model).modules()
             if isinstance(m, GradientCheckpointingLayer)]
    on = [i for i, f in enumerate(flags) if f]
    if not on:
        return Read(("none", 1))
    if len(on) == len(flags):
        return Read(("full", 1))
    k = on[1] - on[0] if len(on) > 1 else len(flags)
    if on == list(range(0, len(flags), k)):
        return Read(("every-k", k))
    raise UnsupportedError(f"activation checkpointing on layers {on} is not every k-th layer: not modelled")


def attention_of(model) -> str:
    name = getattr(getattr(base_model(model), "config", None), "_attn_implementation", None) or "eager"
    if name not in _ATTENTION:
        raise UnsupportedError(f"attn_implementation={name!r} is not modelled ({', '.join(_ATTENTION)})")
    return _ATTENTION[name]


def device_of(model) -> str:
    """The ImplSpec device (whose kernels are modelled): cuda, or cpu."""
    dev = next((p.device for p in _params(model)), None)
    if dev is None or dev.type not in ("cuda", "cpu"):
        raise UnsupportedError(f"parameters on {dev}: trainmem models cuda and cpu kernels")
    return dev.type


def finetune_of(model) -> Read:
    """LoRA/QLoRA from a peft model (adapter names, rank, alpha, dropout and dtype read off the
    adapter layers themselves), or None with a note when parameters are frozen by hand."""
    peft_config = getattr(model, "peft_config", None)
    if not peft_config:
        frozen = sum(p.numel() for p in _params(model) if not p.requires_grad)
        note = (f"{frozen:,} parameters are frozen by hand: not modelled, estimated as trained",) if frozen else ()
        return Read(None, note)
    adapter = getattr(model, "active_adapter", None) or next(iter(peft_config))
    cfg = peft_config[adapter]
    if getattr(cfg, "peft_type", None) is None or str(getattr(cfg.peft_type, "value", cfg.peft_type)) != "LORA":
        raise UnsupportedError(f"peft adapter type {cfg.peft_type} is not modelled (LoRA is)")
    targets, dtypes = set(), set()
    for name, mod in model.named_modules():
        lora_a = getattr(mod, "lora_A", None)
        if lora_a is not None and hasattr(lora_a, "keys") and adapter in lora_a:
            targets.add(name.rsplit(".", 1)[-1])
            dtypes.add(_dtype(lora_a[adapter].weight.dtype))
    if len(dtypes) != 1:
        raise UnsupportedError(f"LoRA adapters in dtypes {sorted(dtypes)}: expected one")
    notes = []
    if getattr(cfg, "modules_to_save", None):
        notes.append(f"peft modules_to_save={list(cfg.modules_to_save)} are not modelled")
    quant = getattr(getattr(base_model(model), "config", None), "quantization_config", None)
    fields = dict(lora_rank=int(cfg.r), lora_alpha=float(cfg.lora_alpha), lora_targets=tuple(sorted(targets)),
                  lora_dropout=float(cfg.lora_dropout), adapter_dtype=dtypes.pop())
    if quant is not None and getattr(quant, "load_in_4bit", False):
        fields.update(quant_type=str(quant.bnb_4bit_quant_type), double_quant=bool(quant.bnb_4bit_use_double_quant),
                      compute_dtype=_dtype(quant.bnb_4bit_compute_dtype))
        return Read(FinetuneSpec(mode="qlora", **fields), tuple(notes))
    return Read(FinetuneSpec(mode="lora", **fields), tuple(notes))


def trainer_optim_of(optim: str, optim_args: str | None, *, device: str, weight_decay: float = 0.0) -> Read:
    """``(trainmem optimizer, ImplSpec.optimizer_impl)`` of a TrainingArguments ``optim`` (before the
    Trainer builds it, :func:`trainer_optim`): ``adamw_torch_fused`` is fused AdamW; ``adamw_torch``,
    ``sgd``, ``rmsprop`` and ``adagrad`` torch's default on ``device``."""
    cls, defaults = trainer_optim(optim, optim_args, weight_decay)
    return _optimizer(cls, defaults, device=device)


def optimizer_of(optimizer, *, device: str) -> Read:
    """``(trainmem optimizer, ImplSpec.optimizer_impl)`` of a torch optimizer (unwrapping
    accelerate's ``AcceleratedOptimizer``), the implementation read from its ``defaults``."""
    opt = getattr(optimizer, "optimizer", optimizer)
    key = optimizer_key(opt)
    for group in getattr(opt, "param_groups", ()):  # the Trainer sets weight decay per group
        check_torch_settings(key, group, f"optimizer {key}")
    return _optimizer(key, getattr(opt, "defaults", {}), device=device)


def _impl(cls: str, defaults: dict, device: str) -> str:
    """What ``optimizer.step()`` runs. torch/optim/adam.py ``adam()`` (sgd.py ``sgd()`` alike): a
    ``fused`` or ``foreach`` given is used; with neither, ``optimizer.py``
    ``_default_to_fused_or_foreach(use_fused=False)`` picks foreach when every parameter is on a
    device with foreach kernels (cuda), else the per-tensor loop (cpu)."""
    if cls not in _TORCH_OPTIMIZERS or ("foreach" not in defaults and "fused" not in defaults):
        return "auto"  # one implementation: the estimate resolves it
    if defaults.get("fused"):
        return "fused"
    foreach = defaults.get("foreach")
    if foreach is None:
        return DEFAULT_IMPL[device]
    return "foreach" if foreach else "for-loop"


def _optimizer(cls: str, defaults: dict, *, device: str) -> Read:
    if cls == "SGD":
        name, notes = ("sgd-momentum" if defaults.get("momentum", 0) else "sgd"), []
    elif cls in OPTIMIZER_CLASSES:
        name, note = OPTIMIZER_CLASSES[cls]
        notes = [note] if note else []
    else:
        raise UnsupportedError(f"optimizer {cls} is not modelled (known: SGD, {', '.join(OPTIMIZER_CLASSES)})")
    return Read((name, _impl(cls, defaults, device)), tuple(notes))
