"""Hugging Face ``TrainingArguments`` as JSON (``TrainingArguments.to_dict()``, or a hand-written
subset) -> overrides, read the way the ``Trainer`` runs them.

Checked against transformers 5.24 (``transformers/training_args.py``, ``trainer.py``,
``trainer_optimizer.py``); the comments name the function.

* ``per_device_train_batch_size``, ``gradient_accumulation_steps``;
* ``bf16``/``fp16``: the Trainer autocasts (accelerate's ``mixed_precision``); over fp32 weights that
  is ``amp-bf16``/``amp-fp16``. The weights' dtype is the model's, not an argument: a model loaded
  in bf16 trains in pure bf16, which a note says. Under ``deepspeed`` DeepSpeed's own precision
  (``mixed-bf16``/``mixed-fp16``) is used instead;
* ``activation_checkpointing`` (``gradient_checkpointing``, its deprecated alias) with
  ``every_n_layers`` in its kwargs -> full / every-k recompute;
* ``optim`` (``adamw_torch``, ``adamw_torch_fused``, ``adamw_bnb_8bit``, ``paged_adamw_8bit``,
  ``lion_8bit``, ``rmsprop``, ``adagrad``, ``rmsprop_bnb_8bit``...) with ``optim_args`` and
  ``weight_decay`` -> optimizer and ``optimizer_impl``; an ``optim`` whose memory is not modelled
  (galore_*, apollo_*, lomo, schedule_free_*, paged_ademamix_*, ...: ``integrations/read.py``
  ``UNMODELLED_TRAINER_OPTIMS``) is an error naming it, as is a weight decay, nesterov or RMSprop
  momentum that gives torch's SGD, RMSprop or Adagrad a temporary or state not modelled;
* ``deepspeed`` (a path or an inline config) -> the DeepSpeed reader; ``fsdp``/``fsdp_config`` ->
  FSDP, ``reshard_after_forward`` and CPU offload; ``use_cpu`` -> CPU kernels;
* TRL's ``SFTConfig`` adds ``max_length`` (older: ``max_seq_length``) -> the sequence length;
  without it the sequence length is not in the arguments, and a note says the default used;
* TRL's ``ModelConfig`` keys (``use_peft``, ``lora_*``, ``load_in_4bit``, ``use_bnb_nested_quant``,
  ``dtype``, ``attn_implementation``) -> LoRA/QLoRA and the weights' dtype (``inputs/trl_model.py``).

``torch_compile`` (with ``torch_compile_backend``/``_mode``) -> ``--compile`` over the whole model
(``inputs/compile_keys.py``); ``use_liger_kernel``, ``label_smoothing_factor``, ``auto_find_batch_size``
and activation offload are noted as not modelled. The other arguments (logging, saving, evaluation,
the hub) do not change a training step's memory and are ignored; a key that is not an argument
of ``TrainingArguments`` is an error naming it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from trainmem.errors import ConfigError
from trainmem.inputs._common import answer, load_json, merge_overrides, positive_int, typed, unknown_key
from trainmem.inputs.compile_keys import hf_compile
from trainmem.inputs.trl_model import TRL_MODEL_KEYS, trl_model_overrides
from trainmem.specs.step import DEFAULT_SEQ, PRECISION_ALIASES

__all__ = ["read_hf_args", "hf_args_overrides", "TRAINING_ARGUMENTS"]

#: ``TrainingArguments``' init fields in transformers 5.24 (``dataclasses.fields``; the tests check it).
TRAINING_ARGUMENTS = (
    'output_dir', 'per_device_train_batch_size', 'num_train_epochs', 'max_steps', 'learning_rate',
    'lr_scheduler_type', 'lr_scheduler_kwargs', 'warmup_steps', 'optim', 'optim_args', 'weight_decay',
    'adam_beta1', 'adam_beta2', 'adam_epsilon', 'optim_target_modules', 'gradient_accumulation_steps',
    'average_tokens_across_devices', 'max_grad_norm', 'label_smoothing_factor', 'bf16', 'fp16',
    'bf16_full_eval', 'fp16_full_eval', 'tf32', 'activation_checkpointing',
    'activation_checkpointing_kwargs', 'gradient_checkpointing', 'gradient_checkpointing_kwargs',
    'torch_compile', 'torch_compile_backend', 'torch_compile_mode', 'use_liger_kernel',
    'liger_kernel_config', 'use_cache', 'neftune_noise_alpha', 'torch_empty_cache_steps',
    'auto_find_batch_size', 'logging_strategy', 'logging_steps', 'logging_first_step', 'log_on_each_node',
    'logging_nan_inf_filter', 'include_num_input_tokens_seen', 'log_level', 'log_level_replica',
    'disable_tqdm', 'report_to', 'run_name', 'project', 'trackio_space_id', 'trackio_bucket_id',
    'trackio_static_space_id', 'eval_strategy', 'eval_steps', 'eval_delay', 'per_device_eval_batch_size',
    'prediction_loss_only', 'eval_on_start', 'eval_do_concat_batches', 'eval_use_gather_object',
    'eval_accumulation_steps', 'include_for_metrics', 'batch_eval_metrics', 'save_only_model',
    'save_strategy', 'save_steps', 'save_on_each_node', 'save_total_limit', 'enable_jit_checkpoint',
    'push_to_hub', 'hub_token', 'hub_private_repo', 'hub_model_id', 'hub_strategy', 'hub_always_push',
    'hub_revision', 'load_best_model_at_end', 'metric_for_best_model', 'greater_is_better',
    'ignore_data_skip', 'restore_callback_states_from_checkpoint', 'full_determinism', 'seed', 'data_seed',
    'use_cpu', 'accelerator_config', 'parallelism_config', 'dataloader_drop_last', 'dataloader_num_workers',
    'dataloader_pin_memory', 'dataloader_persistent_workers', 'dataloader_prefetch_factor',
    'dataloader_multiprocessing_context', 'dataloader_in_order', 'remove_unused_columns', 'label_names',
    'train_sampling_strategy', 'length_column_name', 'ddp_find_unused_parameters', 'ddp_bucket_cap_mb',
    'ddp_broadcast_buffers', 'ddp_static_graph', 'ddp_backend', 'ddp_timeout', 'fsdp', 'fsdp_config',
    'deepspeed', 'debug', 'skip_memory_metrics', 'do_train', 'do_eval', 'do_predict',
    'resume_from_checkpoint', 'local_rank'
)
#: TRL's ``SFTConfig`` keys that change memory (trl/trainer/sft_config.py)
TRL_KEYS = ("max_length", "max_seq_length", "packing", "padding_free")
#: settings that change memory and are not modelled: key -> what the note says
_NOT_MODELLED = {
    "use_liger_kernel": "Liger's fused kernels (RMSNorm, SwiGLU, fused linear cross-entropy) are not modelled",
    "auto_find_batch_size": "the Trainer halves the batch after an out-of-memory error; the estimate is for the "
                            "batch given",
    "padding_free": "padding-free batches are not modelled",
}


def read_hf_args(path: str | Path) -> dict:
    """Overrides from a TrainingArguments JSON file (see the module docstring)."""
    return hf_args_overrides(load_json(path, "TrainingArguments JSON"), str(path))


def hf_args_overrides(cfg: dict, where: str = "hf-args") -> dict:
    known = (*TRAINING_ARGUMENTS, *TRL_KEYS, *TRL_MODEL_KEYS)
    for key in cfg:
        if key not in known:
            raise unknown_key(where, key, known)
    raw: dict[str, Any] = {}
    notes: list[str] = []
    sec: dict[str, dict[str, Any]] = {"step": {}, "impl": {}, "parallel": {}, "finetune": {}}
    step, impl = sec["step"], sec["impl"]

    def get(key: str, kind) -> Any:
        value = cfg.get(key)
        if value is None:
            return None
        raw[key] = value
        return typed(where, key, value, kind)

    if (batch := get("per_device_train_batch_size", int)) is not None:
        step["batch"] = positive_int(where, "per_device_train_batch_size", batch)
    if (accum := get("gradient_accumulation_steps", int)) is not None:
        step["grad_accum"] = positive_int(where, "gradient_accumulation_steps", accum)
    _seq(get, step, notes, where)
    _recompute(get, impl, notes, where)
    _optim(get, step, impl, notes, where)
    if get("use_cpu", bool):
        impl["device"] = "cpu"
    deepspeed = _deepspeed(get, where)
    weights = trl_model_overrides(get, sec, notes, where)  # TRL's ModelConfig: LoRA, 4-bit base, dtype
    step["precision"] = _precision(get, deepspeed, notes, where)
    if weights and deepspeed is None:  # the model is loaded in 16 bits: autocast or not, it computes in them
        step["precision"] = {"bfloat16": "bf16", "float16": "fp16"}[weights]
        notes[-1] = f"dtype={weights}: 16-bit weights, gradients and optimizer states ({step['precision']})"
    _fsdp(get, sec["parallel"], notes, where)
    if deepspeed is not None:
        # the Trainer hands its values to DeepSpeed (integrations/deepspeed.py, HfTrainerDeepSpeedConfig.
        # trainer_config_process fills "auto"; a value both give differently is an error there too)
        sec, _ = merge_overrides([deepspeed, {"source": "hf-args", "overrides": sec}])
        notes.extend(f"deepspeed: {n}".replace("left to the command line and defaults", "filled from these arguments")
                     for n in deepspeed["notes"])
    hf_compile(get, impl, notes)
    for key, note in _NOT_MODELLED.items():
        if get(key, bool):
            notes.append(f"{key}: {note}")
    if get("label_smoothing_factor", (int, float)):
        # trainer_pt_utils.py, LabelSmoother.__call__: log_softmax of the whole logits, kept for backward
        notes.append("label_smoothing_factor: the Trainer's LabelSmoother keeps another log-softmax of the logits; "
                     "not modelled")
    if get("parallelism_config", dict):
        notes.append("parallelism_config (accelerate's tensor/context parallelism) is not read: give --tp/--cp")
    return answer("hf-args", where, raw, sec, notes)


def _seq(get, step: dict, notes: list[str], where: str) -> None:
    key = "max_length" if get("max_length", int) is not None else "max_seq_length"
    seq = get(key, int)
    if seq is None:
        notes.append("the sequence length is not a TrainingArguments setting: it is --seq "
                     f"(default {DEFAULT_SEQ}, or the model's learned positions if fewer)")
        return
    step["seq"] = positive_int(where, key, seq)
    if not get("packing", bool):
        notes.append(f"{key}={seq} truncates; without packing a batch is padded to its longest sample, so {seq} "
                     f"is the most a step sees")


def _recompute(get, impl: dict, notes: list[str], where: str) -> None:
    # training_args.py, TrainingArguments.__post_init__: gradient_checkpointing(_kwargs) are deprecated
    # aliases of activation_checkpointing(_kwargs), used when the new name is not set
    on = get("activation_checkpointing", bool)
    if on is None:
        on = get("gradient_checkpointing", bool)
    kwargs = get("activation_checkpointing_kwargs", dict)
    if kwargs is None:
        kwargs = get("gradient_checkpointing_kwargs", dict) or {}
    if not on:
        return
    # modeling_utils.py, PreTrainedModel.activation_checkpointing_enable: every_n_layers checkpoints
    # layers 0, n, 2n, ...; offload keeps the saved block inputs in host memory
    every = kwargs.get("every_n_layers", 1)
    every = positive_int(where, "activation_checkpointing_kwargs.every_n_layers", every)
    impl.update(recompute="full") if every == 1 else impl.update(recompute="every-k", recompute_every=every,
                                                                  recompute_from="first")
    if kwargs.get("offload"):
        notes.append("activation_checkpointing_kwargs.offload: checkpointed inputs in host memory; not modelled, "
                     "they are counted on the device")


def _optim(get, step: dict, impl: dict, notes: list[str], where: str) -> None:
    # trainer_optimizer.py's handlers, as integrations/read.py trainer_optim reads them: a name whose
    # memory is not modelled (galore_*, lomo, schedule_free_*, ...) is refused, never estimated as AdamW
    from trainmem.errors import UnsupportedError
    from trainmem.integrations.read import OPTIMIZER_CLASSES, trainer_optim

    optim = get("optim", str)
    optim_args = get("optim_args", str)
    if optim is None:
        return
    # TrainingArguments.weight_decay (default 0) reaches the Trainer's decay parameter group
    weight_decay = get("weight_decay", (int, float)) or 0.0
    try:
        cls, defaults = trainer_optim(optim, optim_args, weight_decay)
    except UnsupportedError as e:
        raise ConfigError(f"{where}: {e}") from None
    if cls == "SGD":  # _get_sgd: optim_args "momentum=0.9" reach torch.optim.SGD (a momentum buffer)
        step["optimizer"] = "sgd-momentum" if defaults.get("momentum") else "sgd"
        return
    step["optimizer"], note = OPTIMIZER_CLASSES[cls]
    if note:
        notes.append(f"optim={optim}: {note}")
    if defaults.get("fused"):  # adamw_torch_fused: torch.optim.AdamW(fused=True)
        impl["optimizer_impl"] = "fused"


def _deepspeed(get, where: str) -> dict | None:
    """The DeepSpeed reader's answer for ``deepspeed`` (a path or an inline config)."""
    from trainmem.inputs.deepspeed import deepspeed_overrides, read_deepspeed

    value = get("deepspeed", (str, dict))
    if value is None:
        return None
    return read_deepspeed(value) if isinstance(value, str) else deepspeed_overrides(value, f"{where}: deepspeed")


def _precision(get, deepspeed: dict | None, notes: list[str], where: str) -> str:
    bf16, fp16 = get("bf16", bool), get("fp16", bool)
    if bf16 and fp16:
        raise ConfigError(f"{where}: bf16 and fp16 are both true")
    half = "bf16" if bf16 else "fp16" if fp16 else None
    if deepspeed is not None:
        # integrations/deepspeed.py, HfTrainerDeepSpeedConfig.trainer_config_process: "auto" precision
        # takes the Trainer's bf16/fp16; DeepSpeed keeps fp32 master weights and optimizer states
        given = deepspeed["overrides"].get("step", {}).get("precision")
        if given is not None:
            return given
        return f"mixed-{half}" if half else "fp32"
    # trainer.py, Trainer.create_accelerator_and_postprocess: mixed_precision=bf16/fp16 -> accelerate's
    # autocast; the parameters keep the dtype the model was loaded in
    # bf16 is read as the alias users know (hf-bf16, HF Trainer's bf16=True) that names its recipe (amp-bf16)
    name = {"bf16": "hf-bf16", "fp16": "amp-fp16", None: "fp32"}[half]
    shown = f"{name} = {PRECISION_ALIASES[name]}" if name in PRECISION_ALIASES else name
    notes.append(f"{'bf16=True: autocast' if bf16 else 'fp16=True: autocast' if fp16 else 'no bf16/fp16: no autocast'}"
                 f" over fp32 weights assumed ({shown}); TrainingArguments do not say "
                 f"the weights' dtype: for a model loaded in bfloat16 give --precision bf16")
    return name


def _fsdp(get, par: dict, notes: list[str], where: str) -> None:
    # training_args.py, TrainingArguments._apply_legacy_fsdp_to_config: "full_shard" -> reshard after
    # forward, "shard_grad_op" -> keep, "offload" -> cpu_offload; fsdp=True with fsdp_config
    fsdp = get("fsdp", (bool, str, list))
    items = fsdp.split() if isinstance(fsdp, str) else list(fsdp) if isinstance(fsdp, list) else []
    if not fsdp:
        return
    config = get("fsdp_config", dict) or {}
    par["fsdp"] = "full"
    reshard = config.get("reshard_after_forward", True)
    for item in items:
        if item == "shard_grad_op":
            reshard = False
        elif item in ("hybrid_shard", "hybrid_shard_zero2"):
            raise ConfigError(f"{where}: fsdp={item!r} is FSDP1's hybrid sharding: give --fsdp hybrid --fsdp-group N")
        elif item not in ("full_shard", "offload", "auto_wrap", "no_shard"):
            raise ConfigError(f"{where}: fsdp={item!r} is not a Trainer FSDP option (full_shard, shard_grad_op, "
                              f"offload, auto_wrap)")
    if isinstance(reshard, str):  # FSDP1 writes the strategy name here
        reshard = reshard.lower() not in ("shard_grad_op", "false")
    par["reshard_after_forward"] = bool(reshard)
    # training_args.py _process_fsdp_args: fsdp_config["version"] (default 2); accelerate's key is fsdp_version
    version = config.get("version", config.get("fsdp_version", 2))
    if str(version) not in ("1", "2"):
        raise ConfigError(f"{where}: fsdp_config version={version!r} must be 1 or 2")
    if int(version) == 1:  # 2 is the spec's default
        par["fsdp_version"] = 1
        if str(config.get("use_orig_params", "true")).lower() != "true":
            raise ConfigError(f"{where}: fsdp_config use_orig_params={config['use_orig_params']!r}: FSDP1 is "
                              "modelled with use_orig_params=true (the Trainer's default)")
        notes.append("fsdp version 1: one flat parameter per decoder block, its gradient covering frozen weights")
    if "offload" in items or config.get("cpu_offload"):
        par["offload"] = ("optimizer", "params")
        notes.append("fsdp offload: FSDP's CPU offload; sharded parameters, gradients and optimizer states on "
                     "the host (the host figure)")
    notes.append("fsdp: the Trainer shards over every rank; give --dp for how many")
