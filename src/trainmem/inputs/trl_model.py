"""TRL's ``ModelConfig`` keys in an ``--hf-args`` file: the LoRA adapters and the 4-bit base.

TRL's scripts read one config into ``(ScriptArguments, SFTConfig, ModelConfig)``; the model keys
say how the model is loaded and wrapped (trl/trainer/model_config.py ``ModelConfig``;
trl/trainer/utils.py ``get_peft_config``, ``get_quantization_config``):

* ``use_peft`` -> LoRA with ``lora_r`` (TRL's default 16), ``lora_alpha`` (32), ``lora_dropout``
  (0.05) and ``lora_target_modules`` (None: peft's per-model default, q_proj/v_proj for Llama-style
  models; a one-element list is peft's single string, ``all-linear`` included);
* ``load_in_4bit`` -> QLoRA through ``BitsAndBytesConfig``: ``bnb_4bit_quant_type``,
  ``bnb_4bit_use_double_quant=use_bnb_nested_quant`` (TRL's default **off**) and
  ``bnb_4bit_compute_dtype=dtype`` (TRL's default float32); every linear but the head is 4-bit;
* ``dtype`` bfloat16/float16: the model's weights are 16-bit (pure bf16/fp16, not autocast over
  fp32); ``attn_implementation`` -> the attention kernel.

Refused in one line: ``load_in_8bit`` (LLM.int8 bases), ``use_dora``, ``lora_target_parameters``
(LoRA on expert parameters) and ``lora_modules_to_save`` (trained copies of whole modules).
"""

from __future__ import annotations

from typing import Any, Callable

from trainmem.errors import ConfigError
from trainmem.inputs._common import positive_int

__all__ = ["TRL_MODEL_KEYS", "trl_model_overrides"]

#: TRL ``ModelConfig`` fields (trl main, 2026-07)
TRL_MODEL_KEYS = (
    "model_name_or_path", "model_revision", "dtype", "attn_implementation", "use_peft", "lora_r", "lora_alpha",
    "lora_dropout", "lora_target_modules", "lora_target_parameters", "lora_modules_to_save", "lora_task_type",
    "use_rslora", "use_dora", "load_in_8bit", "load_in_4bit", "bnb_4bit_quant_type", "use_bnb_nested_quant",
    "bnb_4bit_quant_storage",
)
#: ModelConfig's defaults for the keys that change memory
_DEFAULTS = {"lora_r": 16, "lora_alpha": 32, "lora_dropout": 0.05, "bnb_4bit_quant_type": "nf4",
             "use_bnb_nested_quant": False, "dtype": "float32"}
#: attn_implementation -> trainmem attention (transformers' names)
_ATTENTION = {"eager": "eager", "sdpa": "sdpa", "flash_attention_2": "flash", "flash_attention_3": "flash"}
_DTYPES = ("bfloat16", "float16", "float32")


def trl_model_overrides(get: Callable[[str, Any], Any], sec: dict, notes: list[str], where: str) -> str | None:
    """Fill ``sec['finetune']`` and ``sec['impl']`` from the ModelConfig keys; return the weights'
    dtype when ``dtype`` names a 16-bit one (the caller's precision), else None."""
    for key in ("load_in_8bit", "use_dora"):
        if get(key, bool):
            raise ConfigError(f"{where}: {key}=true is not modelled ({'an LLM.int8 base' if key == 'load_in_8bit' else 'DoRA'})")
    for key in ("lora_target_parameters", "lora_modules_to_save"):
        if get(key, list):
            raise ConfigError(f"{where}: {key} is not modelled (LoRA on parameters / trained module copies)")
    if (attn := get("attn_implementation", str)) is not None:
        if attn not in _ATTENTION:
            raise ConfigError(f"{where}: attn_implementation={attn!r} is not one of {', '.join(_ATTENTION)}")
        sec["impl"]["attention"] = _ATTENTION[attn]
    dtype = get("dtype", str)
    if dtype is not None and dtype not in (*_DTYPES, "auto"):
        raise ConfigError(f"{where}: dtype={dtype!r} is not one of auto, {', '.join(_DTYPES)}")
    if get("model_name_or_path", str):
        notes.append("model_name_or_path is not read: give --model (a preset, a config.json or ORG/NAME in the HF cache)")
    four_bit = get("load_in_4bit", bool)
    if not get("use_peft", bool):
        if four_bit:
            raise ConfigError(f"{where}: load_in_4bit needs use_peft (TRL trains a 4-bit base only through LoRA)")
        return dtype if dtype in ("bfloat16", "float16") else None

    def value(key: str, kind):
        got = get(key, kind)
        return _DEFAULTS[key] if got is None else got

    ft = sec.setdefault("finetune", {})
    ft.update(mode="qlora" if four_bit else "lora", lora_rank=positive_int(where, "lora_r", value("lora_r", int)),
              lora_alpha=float(value("lora_alpha", (int, float))), lora_dropout=float(value("lora_dropout", (int, float))))
    targets = get("lora_target_modules", (list, str))
    if targets is None:
        notes.append("lora_target_modules not set: peft's default for the model type (q_proj, v_proj for Llama-style "
                     "models) assumed")
    else:
        ft["lora_targets"] = (targets,) if isinstance(targets, str) else tuple(targets)
    task = get("lora_task_type", str)
    if task not in (None, "CAUSAL_LM"):
        notes.append(f"lora_task_type={task}: the head is --head's (peft's modules_to_save for it is not modelled)")
    if four_bit:
        nested = value("use_bnb_nested_quant", bool)
        ft.update(quant_type=value("bnb_4bit_quant_type", str), double_quant=bool(nested))
        compute = value("dtype", str)
        if compute == "auto":
            notes.append("dtype=auto: the 4-bit compute dtype is the checkpoint's; bfloat16 assumed")
            compute = "bfloat16"
        ft["compute_dtype"] = compute
        notes.append(f"load_in_4bit: every linear but the head is bitsandbytes NF4/FP4 (double quantization "
                     f"{'on' if nested else 'off: TRL default'}, compute dtype {compute}); SFTTrainer's "
                     "prepare_model_for_kbit_training upcasts norms, embeddings and the head to fp32: not modelled")
    return dtype if dtype in ("bfloat16", "float16") else None
