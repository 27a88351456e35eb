"""A torchtune recipe config (YAML) -> overrides, read the way torchtune's fine-tuning recipes run it.

Checked against pytorch/torchtune bd2a0fc (2026-04); the comments name the file and function. The
supervised fine-tuning recipes are modelled (``recipes/full_finetune_single_device.py``,
``full_finetune_distributed.py``, ``lora_finetune_single_device.py``, ``lora_finetune_distributed.py``):

* ``model._component_`` -> a bundled preset (``torchtune.models.llama3.lora_llama3_8b`` -> llama-3-8b);
  a ``lora_``/``qlora_`` builder, ``lora_attn_modules``, ``apply_lora_to_mlp``/``_output``,
  ``lora_rank``/``alpha``/``dropout`` and ``quantize_base`` -> the fine-tuning spec (torchtune's
  module names mapped to Hugging Face's: ``output_proj`` -> ``o_proj``, ``w1/w2/w3`` ->
  ``gate_proj/down_proj/up_proj``, ``output`` -> ``lm_head``);
* ``batch_size``, ``gradient_accumulation_steps``, ``tokenizer.max_seq_len`` (with
  ``dataset.packed`` every sequence is that long; without, it is the longest a sample can be),
  ``dtype`` (torchtune builds the model in it: ``bf16`` is pure bf16), ``device``;
* ``optimizer._component_`` and the keywords that change its memory (``inputs/torchtune_optim.py``:
  an optimizer not modelled is an error), ``optimizer_in_bwd`` (full fine-tuning only),
  ``enable_activation_checkpointing``, ``ac_mode``/``ac_option``, ``loss._component_``;
* the distributed recipes' ``fsdp_cpu_offload``, ``fsdp_reshard_after_forward`` and degrees;
* ``enable_activation_offloading`` -> ``--offload activations`` on one device (only with
  ``enable_activation_checkpointing``, as the recipes require; a setting it is not modelled under
  gets a note).

* ``compile`` -> ``--compile --compile-scope block-loss`` (each layer and the loss compiled alone:
  ``inputs/compile_keys.py``).

Settings that change memory but are not modelled (DoRA...) are
listed in the notes; recipes with more than one model (distillation, DPO, PPO,
GRPO) and quantization-aware training are refused. Keys that do not change memory (logging,
checkpointing, schedules) are ignored; any other key is an error naming it. Nothing in the file
is executed: ``_component_`` paths are read as text and the YAML is parsed with ``safe_load``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from trainmem.errors import ConfigError
from trainmem.inputs._common import answer, load_mapping, positive_int, typed, unknown_key
from trainmem.inputs.compile_keys import torchtune_compile
from trainmem.inputs.torchtune_optim import read_optimizer
from trainmem.specs.step import DEFAULT_SEQ

__all__ = ["read_torchtune", "torchtune_overrides"]

#: torchtune model builder (without ``lora_``/``qlora_``) -> (preset, note). Llama 3.1 8B/70B have
#: Llama 3's shapes (torchtune/models/llama3_1/_model_builders.py: embed_dim, num_layers, heads,
#: intermediate_dim and vocab_size equal llama3's); only RoPE scaling and context length differ,
#: and neither holds memory at a given sequence length.
_SAME_SHAPES = "has {0}'s shapes (only RoPE scaling and context length differ): estimated with the {0} preset"
_MODELS: dict[str, tuple[str, str]] = {
    "llama2_7b": ("llama-2-7b", ""), "llama2_13b": ("llama-2-13b", ""), "llama2_70b": ("llama-2-70b", ""),
    "llama3_8b": ("llama-3-8b", ""), "llama3_70b": ("llama-3-70b", ""),
    "llama3_1_8b": ("llama-3-8b", _SAME_SHAPES.format("llama-3-8b")),
    "llama3_1_70b": ("llama-3-70b", _SAME_SHAPES.format("llama-3-70b")),
    "llama3_1_405b": ("llama-3.1-405b", ""),
    "mistral_7b": ("mistral-7b", ""),  # torchtune/models/mistral/_model_builders.py: v0.1 shapes, vocab 32000
}
#: torchtune LoRA module names -> Hugging Face's (torchtune/models/convert_weights.py, _FROM_HF)
_ATTN = {"q_proj": "q_proj", "k_proj": "k_proj", "v_proj": "v_proj", "output_proj": "o_proj"}
_MLP = ("gate_proj", "down_proj", "up_proj")  # w1, w2, w3
#: lora_llama3_8b's defaults (torchtune/models/llama3/_model_builders.py)
_LORA_DEFAULTS = {"apply_lora_to_mlp": False, "apply_lora_to_output": False, "lora_rank": 8, "lora_alpha": 16,
                  "lora_dropout": 0.0, "quantize_base": False, "use_dora": False}
#: torchtune/training/precision.py, PRECISION_STR_TO_DTYPE: the model is built in this dtype
_DTYPES = {"bf16": "bf16", "fp32": "fp32", "fp16": "fp16"}
#: loss class path -> (trainmem loss, note)
_LOSSES: dict[str, tuple[str, str]] = {
    "torch.nn.CrossEntropyLoss": ("ce", ""),
    # torchtune/modules/loss/ce_chunked_output_loss.py, CEWithChunkedOutputLoss.forward, with the
    # model's set_num_output_chunks(8): every chunk's bf16 logits, one chunk upcast at a time, every
    # chunk's fp32 log-softmax kept for backward (estimate/losses.py)
    "torchtune.modules.loss.CEWithChunkedOutputLoss": ("torchtune-chunked-ce", ""),
    # cross_entropy_loss.py, LinearCrossEntropyLoss.compute_cross_entropy: the output projection runs
    # per chunk of unmasked tokens, and each chunk's fp32 log-softmax is kept for backward
    "torchtune.modules.loss.LinearCrossEntropyLoss": (
        "ce", "LinearCrossEntropyLoss keeps every chunk's fp32 log-softmax for backward: estimated as plain "
              "cross-entropy (the bf16 logits it never materializes whole are counted)"),
}
_DEVICES = ("cuda", "cpu")
_MODEL_KEYS = ("_component_", "lora_attn_modules", *_LORA_DEFAULTS)

#: keys the modelled recipes read that change memory (handled below)
_READ = {"model", "tokenizer", "dataset", "batch_size", "gradient_accumulation_steps", "dtype", "device",
         "optimizer", "optimizer_in_bwd", "enable_activation_checkpointing", "enable_activation_offloading",
         "ac_mode", "ac_option", "compile", "loss", "fsdp_cpu_offload", "fsdp_reshard_after_forward",
         "custom_sharded_layers", "tensor_parallel_dim", "tensor_parallel_plan", "context_parallel_dim",
         "data_parallel_shard_dim", "data_parallel_replicate_dim", "enable_fp8_training", "fp8_recipe_name"}
#: keys that do not change a training step's memory
_IGNORED = {"output_dir", "seed", "shuffle", "epochs", "max_steps_per_epoch", "checkpointer", "resume_from_checkpoint",
            "save_adapter_weights_only", "lr_scheduler", "metric_logger", "log_every_n_steps", "log_level",
            "log_peak_memory_stats", "profiler", "low_cpu_ram", "run_val_every_n_steps", "dataset_val",
            "batch_size_val", "collate_fn", "clip_grad_norm", "save_every_n_steps", "save_every_n_epochs",
            "enable_async_checkpointing", "cudnn_deterministic_mode", "profile_memory", "use_distributed_state_dict",
            "context_parallel_rotate_method"}
#: keys of recipes that hold more than one model or change the step: refused, with the reason
_OTHER_RECIPES = {
    "teacher_model": "knowledge distillation (a teacher model)", "kd_loss": "knowledge distillation",
    "policy_model": "PPO (policy, reference, reward and value models)", "reward_and_value_model": "PPO",
    "ref_checkpointer": "DPO (a reference model)", "ref_policy_checkpointer": "PPO",
    "reward_functions": "GRPO", "grpo_samples": "GRPO", "quantizer": "quantization-aware training",
}


def read_torchtune(path: str | Path) -> dict:
    """Overrides from a torchtune recipe config (see the module docstring)."""
    return torchtune_overrides(load_yaml(path, "torchtune config"), str(path))


def load_yaml(path: str | Path, what: str) -> dict:
    """A YAML mapping read with PyYAML's SafeLoader (plain data: no tags that build objects), without
    aliases."""
    try:
        import yaml
    except ModuleNotFoundError:
        raise ConfigError(f"{path}: reading a {what} needs PyYAML: pip install pyyaml") from None
    class NoAliases(yaml.SafeLoader):  # SafeLoader builds plain data only; aliases could nest a file exponentially
        def compose_node(self, parent, index):
            if self.check_event(yaml.AliasEvent):
                raise yaml.composer.ComposerError(None, None, "aliases (*name) are not read",
                                                  self.peek_event().start_mark)
            return super().compose_node(parent, index)

    def parse(text: str) -> Any:
        try:
            return yaml.load(text, Loader=NoAliases)  # noqa: S506 - a SafeLoader
        except yaml.YAMLError as exc:
            mark = getattr(exc, "problem_mark", None)
            where = f" at line {mark.line + 1}" if mark else ""
            raise ConfigError(f"{path}: invalid YAML{where}: {getattr(exc, 'problem', None) or exc}") from None
    return load_mapping(path, what, "YAML", parse)


def torchtune_overrides(cfg: dict, where: str = "torchtune") -> dict:
    for key in cfg:
        if key in _OTHER_RECIPES:
            raise ConfigError(f"{where}: {key}: {_OTHER_RECIPES[key]} is not modelled; trainmem reads the "
                              f"supervised fine-tuning recipes (full and LoRA/QLoRA)")
        if key not in _READ | _IGNORED:
            raise unknown_key(where, str(key), _READ | _IGNORED)
    raw: dict[str, Any] = {}
    notes: list[str] = []
    sec: dict[str, dict[str, Any]] = {"model": {}, "step": {}, "impl": {}, "parallel": {}, "finetune": {}}

    def get(key: str, kind, sub: str | None = None) -> Any:
        node = cfg.get(sub, {}) if sub else cfg
        if sub and not isinstance(node, dict):
            raise ConfigError(f"{where}: {sub} must be a mapping, got {node!r:.40}")
        value = node.get(key)
        name = f"{sub}.{key}" if sub else key
        if value is None:
            return None
        raw[name] = value
        return value if kind is None else typed(where, name, value, kind)

    needs_model = _model(get, cfg.get("model"), sec, notes, where)
    step, impl = sec["step"], sec["impl"]
    if (batch := get("batch_size", int)) is not None:
        step["batch"] = positive_int(where, "batch_size", batch)
    if (accum := get("gradient_accumulation_steps", int)) is not None:
        step["grad_accum"] = positive_int(where, "gradient_accumulation_steps", accum)
    _seq(get, step, notes, where)
    # full_finetune_single_device.py, FullFinetuneRecipeSingleDevice.__init__:
    # training.get_dtype(cfg.dtype) and the model is built under training.set_default_dtype(dtype)
    dtype = get("dtype", str)
    if dtype is None:
        notes.append("dtype not given: torchtune's training.get_dtype(None) is fp32")
        dtype = "fp32"
    if dtype not in _DTYPES:
        raise ConfigError(f"{where}: dtype={dtype!r} must be bf16, fp32 or fp16")
    step["precision"] = _DTYPES[dtype]
    if (device := get("device", str)) is not None:
        if device in _DEVICES:
            impl["device"] = device
        else:
            notes.append(f"device={device!r}: estimated with CUDA's kernels")
    read_optimizer(get, cfg.get("optimizer"), step, impl, where)
    _optimizer_in_bwd(get, step, impl, sec["finetune"], notes, where)
    _loss(get, step, notes, where)
    _checkpointing(get, impl, notes, where)
    _distributed(get, sec["parallel"], notes, where)
    _offloading(get, impl, sec["parallel"], sec["finetune"], notes, where)
    torchtune_compile(get("compile", (bool, dict)), impl, notes, where)
    _float8(get, impl, sec["parallel"], sec["finetune"], notes)
    out = answer("torchtune", where, raw, sec, notes)
    if needs_model:
        out["needs_model"] = needs_model
    return out


def _model(get, model_cfg: Any, sec: dict, notes: list[str], where: str) -> str | None:
    """Sets the model preset and the fine-tuning; returns the error to raise unless --model is typed
    when the builder has no preset."""
    if not isinstance(model_cfg, dict):
        raise ConfigError(f"{where}: model must be a mapping with a _component_, got {model_cfg!r:.40}")
    for key in model_cfg:
        if key not in _MODEL_KEYS:
            raise unknown_key(f"{where}: model", str(key), _MODEL_KEYS)
    component = get("_component_", str, "model")
    if component is None:
        raise ConfigError(f"{where}: model._component_ is missing (e.g. torchtune.models.llama3.lora_llama3_8b)")
    builder = component.rsplit(".", 1)[-1]
    mode = "qlora" if builder.startswith("qlora_") else "lora" if builder.startswith("lora_") else "full"
    base = builder.split("_", 1)[1] if mode != "full" else builder
    preset, note = _MODELS.get(base, (None, ""))
    needs_model = None
    if preset is None:
        needs_model = (f"{where}: model._component_={component!r} has no bundled preset (known builders: "
                       f"{', '.join(sorted(_MODELS))}); give the model with --model")
        notes.append(f"model._component_={component!r}: the model is --model's")
    else:
        sec["model"]["name"] = preset
    if note:
        notes.append(f"{component} {note}")
    notes.append("torchtune's own modules are estimated with the Hugging Face module rules (--profile hf): "
                 "the same layers and kernels, small differences in what each keeps")
    if mode == "full":
        for key in ("lora_attn_modules", *_LORA_DEFAULTS):
            if key in model_cfg:
                raise ConfigError(f"{where}: model.{key} needs a lora_ or qlora_ model builder, not {builder}")
    else:
        _lora(get, sec["finetune"], mode, notes, where)
    return needs_model


def _float8(get, impl: dict, par: dict, ft: dict, notes: list[str]) -> None:
    """enable_fp8_training, fp8_recipe_name: full_finetune_distributed.py (_setup_model) converts with
    torchtune/training/quantization.py convert_to_float8_training (bd2a0fc): no recipe name is
    tensorwise with enable_fsdp_float8_all_gather=True, every nn.Linear but ``output`` (trainmem's
    filter also skips dims not multiples of 16, which torchtune's does not). Only that recipe reads it."""
    if not get("enable_fp8_training", bool):
        return
    recipe = get("fp8_recipe_name", str)
    if ft.get("mode", "full") != "full" or not par.get("fsdp"):
        notes.append("enable_fp8_training: only full_finetune_distributed reads it; ignored here")
    elif recipe not in (None, "tensorwise", "rowwise"):
        notes.append(f"fp8_recipe_name={recipe!r} is not modelled: estimated without Float8")
    else:
        impl["float8"] = recipe or "tensorwise"
        if recipe is None:
            impl["float8_all_gather"] = True


def _lora(get, ft: dict, mode: str, notes: list[str], where: str) -> None:
    """torchtune/models/llama3/_component_builders.py, lora_llama3: adapters on the named attention
    projections, on w1/w2/w3 with apply_lora_to_mlp, on the output head with apply_lora_to_output;
    the qlora_ builders are functools.partial(lora_..., quantize_base=True)."""
    attn = get("lora_attn_modules", list, "model")
    if not attn:
        raise ConfigError(f"{where}: model.lora_attn_modules must name at least one of {', '.join(_ATTN)}")
    targets = []
    for name in attn:
        if not isinstance(name, str) or name not in _ATTN:
            raise ConfigError(f"{where}: model.lora_attn_modules: {name!r} is not one of {', '.join(_ATTN)}")
        targets.append(_ATTN[name])
    defaulted = []

    def lora(key: str, kind) -> Any:
        value = get(key, kind, "model")
        if value is None:
            if key not in ("use_dora", "quantize_base"):  # off unless asked (qlora_ builders set quantize_base)
                defaulted.append(f"{key}={_LORA_DEFAULTS[key]!r}")
            return _LORA_DEFAULTS[key]
        return value

    if lora("apply_lora_to_mlp", bool):
        targets += _MLP
    if lora("apply_lora_to_output", bool):
        targets.append("lm_head")
    if lora("use_dora", bool):
        raise ConfigError(f"{where}: model.use_dora=True: DoRA (a weight norm per adapted layer) is not modelled")
    if lora("quantize_base", bool):
        mode = "qlora"
    rank = positive_int(where, "model.lora_rank", lora("lora_rank", int))
    ft.update(mode=mode, lora_targets=tuple(targets), lora_rank=rank,
              lora_alpha=float(lora("lora_alpha", (int, float))),
              lora_dropout=float(lora("lora_dropout", (int, float))),
              # lora_finetune_single_device.py, _setup_model: built under set_default_dtype(dtype), so the
              # adapters have the base weights' dtype
              adapter_dtype="param")
    if mode == "qlora":
        # torchtune/modules/peft/lora.py, LoRALinear: to_nf4(weight) with torchao's defaults
        # (block_size=64, scaler_block_size=256): FinetuneSpec's nf4 defaults, in torchao's NF4Tensor
        # layout. Since torchtune 0.3 (PR #1119) the linears without adapters are FrozenNF4Linear too
        # (_component_builders.py), the output head never (its "TODO: quantize_base is not applied to
        # final output_proj"): qlora_scope all, the head in the base dtype.
        ft.update(quant_impl="torchao-nf4", qlora_scope="all")
        notes.append("quantize_base: every linear but the output head as torchao NF4 (to_nf4: blocks of 64, "
                     "scalers in blocks of 256; torchtune >= 0.3)")
    if defaulted:
        notes.append("torchtune's LoRA builder defaults for keys the file leaves out: " + ", ".join(defaulted))


def _seq(get, step: dict, notes: list[str], where: str) -> None:
    # torchtune/datasets/_sft.py, SFTDataset: samples truncated to tokenizer.max_seq_len;
    # padded_collate_sft pads a batch to its longest sample; packed=True (torchtune/datasets/_packed.py,
    # PackedDataset) fills every sequence to max_seq_len exactly
    max_seq = get("max_seq_len", int, "tokenizer")
    packed = get("packed", bool, "dataset")
    if max_seq is None:
        if packed:
            raise ConfigError(f"{where}: dataset.packed=True needs tokenizer.max_seq_len (PackedDataset)")
        notes.append("tokenizer.max_seq_len is null: samples are as long as the data makes them; the sequence "
                     f"length is --seq (default {DEFAULT_SEQ}, or the model's learned positions if fewer)")
        return
    step["seq"] = positive_int(where, "tokenizer.max_seq_len", max_seq)
    if not packed:
        notes.append(f"dataset not packed: batches are padded to their longest sample, so seq={max_seq} "
                     f"(tokenizer.max_seq_len) is the most a step sees")


def _optimizer_in_bwd(get, step: dict, impl: dict, finetune: dict, notes: list[str], where: str) -> None:
    # full_finetune_single_device.py, _setup_optimizer: optimizer_in_bwd registers one optimizer per
    # parameter stepped in a post-accumulate-grad hook (training.register_optim_in_bwd_hooks); __init__
    # raises with gradient accumulation or clipping; the LoRA recipes never read the key
    if not get("optimizer_in_bwd", bool):
        return
    if finetune.get("mode") in ("lora", "qlora"):
        notes.append("optimizer_in_bwd: torchtune's LoRA recipes do not read it (full_finetune_* do): the optimizer "
                     "steps after backward")
        return
    if step.get("grad_accum", 1) > 1 or get("clip_grad_norm", (int, float, str)) is not None:
        raise ConfigError(f"{where}: optimizer_in_bwd=True with gradient_accumulation_steps={step.get('grad_accum', 1)}"
                          f", clip_grad_norm={get('clip_grad_norm', (int, float, str))!r}: torchtune's full_finetune "
                          f"recipes refuse both (each needs every gradient before the step)")
    impl["optimizer_in_backward"] = True


def _loss(get, step: dict, notes: list[str], where: str) -> None:
    component = get("_component_", str, "loss")
    if component is None:
        return
    if component not in _LOSSES:
        raise ConfigError(f"{where}: loss._component_={component!r} is not modelled (known: "
                          f"{', '.join(_LOSSES)}); trainmem reads the supervised fine-tuning recipes")
    step["loss"], note = _LOSSES[component]
    if note:
        notes.append(note)
    if step["loss"] != "torchtune-chunked-ce":  # estimate/torchtune_loop.py: counted under that loss only
        notes.append(f"the recipe's ignore_labels_cache ((batch_size, 1) int64, batch_size·8 bytes all step) is not "
                     f"counted with {component.rpartition('.')[2]}: the estimate keeps it under CEWithChunkedOutputLoss")


def _checkpointing(get, impl: dict, notes: list[str], where: str) -> None:
    # lora_finetune_single_device.py, _setup_model: training.set_activation_checkpointing(model,
    # auto_wrap_policy={modules.TransformerSelfAttentionLayer}): every block
    enabled = get("enable_activation_checkpointing", bool)
    mode, option = get("ac_mode", str), get("ac_option", (int, str))
    if mode is None:
        if enabled:
            impl["recompute"] = "full"
        return
    # full_finetune_distributed.py, _setup_model: apply_selective_activation_checkpointing only when
    # enable_activation_checkpointing is False, set_activation_checkpointing only when ac_mode is None
    if enabled:
        impl["recompute"] = "none"
        notes.append(f"enable_activation_checkpointing=True with ac_mode={mode!r}: torchtune's recipe applies "
                     f"neither (ac_mode only when enable_activation_checkpointing is False, full checkpointing "
                     f"only when ac_mode is unset): no activation checkpointing")
        return
    # torchtune/training/activations.py, checkpoint_wrapper: "full" wraps every layer; "selective" reads
    # int(ac_option) and wraps every k-th layer, every layer at 0; any other mode wraps none
    if mode == "full":
        impl["recompute"] = "full"
    elif mode == "none":
        impl["recompute"] = "none"
    elif mode == "selective" and str(option).isdigit():  # typed: an int or a str, never a bool
        every = int(option)
        if every in (0, 1):
            impl["recompute"] = "full"
        else:
            impl.update(recompute="every-k", recompute_every=every)
    else:
        raise ConfigError(f"{where}: ac_mode={mode!r} with ac_option={option!r}: expected none, full, or selective "
                          f"with a non-negative integer (torchtune's checkpoint_wrapper reads int(ac_option): "
                          f"'op' fails there)")


def _offloading(get, impl: dict, par: dict, finetune: dict, notes: list[str], where: str) -> None:
    # full_finetune_single_device.py, _setup_model: training.get_act_offloading_ctx_manager(model,
    # enable_activation_offloading) -> OffloadActivations around the forward (estimate/activation_offload.py)
    # full_finetune_distributed.py wraps the sharded model's forward the same way: with data parallelism
    # only, each rank's split is the single-device one (estimate/fsdp_offload.py)
    if not get("enable_activation_offloading", bool):
        return
    # full_finetune_single_device.py / lora_finetune_*.py __init__: RuntimeError without checkpointing
    if not get("enable_activation_checkpointing", bool):
        raise ConfigError(f"{where}: enable_activation_offloading=True needs enable_activation_checkpointing=True "
                          f"(torchtune's recipes raise RuntimeError without it)")
    if (impl.get("recompute", "none") not in ("none", "full") or par.get("tp", 1) > 1 or par.get("cp", 1) > 1
            or finetune):
        notes.append("enable_activation_offloading: modelled on one device (or data-parallel FSDP ranks), full "
                     "fine-tuning, with full or no activation checkpointing; here the saved activations are counted "
                     "on the device")
        return
    par["offload"] = tuple(par.get("offload", ())) + ("activations",)


def _distributed(get, par: dict, notes: list[str], where: str) -> None:
    """The distributed recipes shard with FSDP2 over the data-parallel ranks
    (full_finetune_distributed.py, _setup_model: training.shard_model(..., reshard_after_forward))."""
    keys = ("fsdp_cpu_offload", "fsdp_reshard_after_forward", "custom_sharded_layers", "data_parallel_shard_dim",
            "data_parallel_replicate_dim", "tensor_parallel_dim", "context_parallel_dim", "tensor_parallel_plan")
    present = [k for k in keys if get(k, None) is not None]
    if not present:
        return
    par["fsdp"] = "full"
    shard = get("data_parallel_shard_dim", int)
    replicate = get("data_parallel_replicate_dim", int) or 1
    if shard is None or shard == -1:  # full_finetune_distributed.py: -1 means to infer from the world size
        notes.append("a distributed recipe: FSDP over the ranks the other degrees leave "
                     "(data_parallel_shard_dim=-1); give --dp for how many")
    else:
        par["dp"] = replicate * positive_int(where, "data_parallel_shard_dim", shard)
        if replicate > 1:
            par.update(fsdp="hybrid", fsdp_group=shard)
    for key, field in (("tensor_parallel_dim", "tp"), ("context_parallel_dim", "cp")):
        if (value := get(key, int)) is not None:
            par[field] = positive_int(where, key, value)
    if par.get("tp", 1) > 1:
        notes.append("tensor_parallel_plan is not read: tensor parallelism modelled without sequence parallelism")
    # training.shard_model: fully_shard(reshard_after_forward=cfg.get("fsdp_reshard_after_forward", True))
    if (reshard := get("fsdp_reshard_after_forward", bool)) is not None:
        par["reshard_after_forward"] = reshard
    if get("fsdp_cpu_offload", bool):
        # shard_model(cpu_offload=True): fully_shard(offload_policy=CPUOffloadPolicy()) keeps parameter and
        # gradient shards on the host, and the optimizer steps there (estimate/fsdp_offload.py)
        par["offload"] = ("optimizer", "params")
        notes.append("fsdp_cpu_offload: FSDP2's CPUOffloadPolicy; sharded parameters, gradients and optimizer "
                     "states in pinned host memory (the host figure)")
    # training.shard_model: each module whose last name is in custom_sharded_layers is fully_shard-ed
    # on its own (the 70B configs: ['tok_embeddings', 'output']); estimate/fsdp_units.py
    if layers := get("custom_sharded_layers", list):
        if {"tok_embeddings", "output"} <= set(layers):
            par["fsdp_units"] = "blocks+embed+head"
        else:
            notes.append(f"custom_sharded_layers={layers}: only ['tok_embeddings', 'output'] together are "
                         "modelled (--fsdp-units blocks+embed+head); kept in the root")
