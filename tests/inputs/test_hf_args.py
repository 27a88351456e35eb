"""Hugging Face TrainingArguments JSON -> spec fields, as the Trainer runs them (issue 13, item 9).

Each file is written by the real ``transformers.TrainingArguments(...).to_dict()``, so every key
read is one the class really has; citations are to transformers 5.24.
"""

from __future__ import annotations

import dataclasses
import json
import re

import pytest

from trainmem.cli import main
from trainmem.errors import ConfigError
from trainmem.inputs import read_hf_args
from trainmem.inputs.hf_args import TRAINING_ARGUMENTS
from trainmem.specs.step import DEFAULT_SEQ

transformers = pytest.importorskip("transformers")


def args_file(tmp_path, **kwargs) -> str:
    """A JSON file holding ``TrainingArguments(**kwargs).to_dict()``."""
    d = transformers.TrainingArguments(output_dir=str(tmp_path / "out"), use_cpu=True, **kwargs).to_dict()
    p = tmp_path / "args.json"
    p.write_text(json.dumps(d, default=str))
    return str(p)


def written(tmp_path, d) -> str:
    p = tmp_path / "subset.json"
    p.write_text(json.dumps(d))
    return str(p)


def test_known_keys_are_the_real_class_fields():
    fields = [f.name for f in dataclasses.fields(transformers.TrainingArguments) if f.init]
    assert list(TRAINING_ARGUMENTS) == fields


def test_to_dict_of_a_real_run(tmp_path):
    a = read_hf_args(args_file(tmp_path, per_device_train_batch_size=4, gradient_accumulation_steps=8, bf16=True,
                               gradient_checkpointing=True, optim="adamw_torch_fused"))
    assert a["overrides"] == {
        "step": {"batch": 4, "grad_accum": 8,
                 "optimizer": "adamw",
                 "precision": "hf-bf16"},  # Trainer: accelerate autocast over the model's fp32 weights (amp-bf16)
        # __post_init__: gradient_checkpointing is activation_checkpointing's alias -> every layer
        "impl": {"recompute": "full", "optimizer_impl": "fused",  # trainer_optimizer.py: AdamW(fused=True)
                 "device": "cpu"},  # use_cpu
    }
    notes = "\n".join(a["notes"])
    assert f"--seq (default {DEFAULT_SEQ}" in notes  # the sequence length is not an argument
    assert "bf16=True: autocast over fp32 weights assumed (hf-bf16 = amp-bf16)" in notes and "--precision bf16" in notes


@pytest.mark.parametrize("optim, optimizer, impl, note", [
    ("adamw_torch", "adamw", None, None),  # torch.optim.AdamW with torch's default (foreach on CUDA)
    ("adamw_torch_fused", "adamw", "fused", None),
    ("adamw_bnb_8bit", "adamw8bit", None, None),  # bnb.optim.AdamW(optim_bits=8)
    ("adamw_8bit", "adamw8bit", None, None),
    ("paged_adamw_8bit", "paged-adamw8bit", None, None),  # paged states: their own figure, no note needed
    ("paged_adamw_32bit", "paged-adamw32bit", None, None),
    ("adamw_torch_8bit", "torchao-adamw8bit", None, None),  # torchao.optim.AdamW8bit
    ("adamw_torch_4bit", "torchao-adamw4bit-block256", None, None),  # AdamW4bit(block_size=256)
    ("adafactor", "adafactor", None, None),
    ("sgd", "sgd", None, None),
    # _get_bitsandbytes_optimizer: Lion / RMSprop with optim_bits=8 if "8bit" in optim else 32, is_paged
    ("lion_32bit", "lion32bit", None, None), ("lion_8bit", "lion8bit", None, None),
    ("paged_lion_32bit", "paged-lion32bit", None, None), ("paged_lion_8bit", "paged-lion8bit", None, None),
    ("rmsprop_bnb", "rmsprop32bit", None, None), ("rmsprop_bnb_32bit", "rmsprop32bit", None, None),
    ("rmsprop_bnb_8bit", "rmsprop8bit", None, None),
    ("rmsprop", "rmsprop", None, None), ("adagrad", "adagrad", None, None),  # _get_rmsprop, _get_adagrad: torch's
    ("ademamix", "ademamix", None, None), ("ademamix_8bit", "ademamix8bit", None, None),  # bnb AdEMAMix(optim_bits)
])
def test_optim_names(tmp_path, optim, optimizer, impl, note):
    a = read_hf_args(args_file(tmp_path, optim=optim))
    assert a["overrides"]["step"]["optimizer"] == optimizer
    assert a["overrides"].get("impl", {}).get("optimizer_impl") == impl
    assert any(note in n for n in a["notes"]) if note else not any("paged" in n for n in a["notes"])


def test_unmodelled_settings_are_said(tmp_path):
    a = read_hf_args(args_file(tmp_path, torch_compile=True, optim="adamw_torch", label_smoothing_factor=0.1,
                               auto_find_batch_size=True, activation_checkpointing=True,
                               activation_checkpointing_kwargs={"every_n_layers": 4, "offload": True}))
    # torch_compile is mapped (whole model: inputs/compile_keys.py), no longer noted as unmodelled
    assert a["overrides"]["impl"] == {"recompute": "every-k", "recompute_every": 4, "device": "cpu",
                                      "recompute_from": "first",  # transformers' layers 0, 4, 8 (ImplSpec.checkpointed)
                                      "compile": True, "compile_scope": "model"}
    notes = "\n".join(a["notes"])
    for said in ("torch_compile", "label_smoothing_factor",
                 "auto_find_batch_size", "activation_checkpointing_kwargs.offload"):
        assert said in notes


def test_sgd_momentum_and_liger(tmp_path):
    # trainer_optimizer.py: optim_args "momentum=0.9" reach torch.optim.SGD (a momentum buffer per parameter)
    a = read_hf_args(written(tmp_path, {"optim": "sgd", "optim_args": "momentum=0.9", "use_liger_kernel": True}))
    assert a["overrides"]["step"]["optimizer"] == "sgd-momentum"
    assert any(n.startswith("use_liger_kernel: ") for n in a["notes"])


def test_trl_sequence_and_subset(tmp_path):
    # TRL's SFTConfig: max_length truncates; packing fills every sequence
    a = read_hf_args(written(tmp_path, {"per_device_train_batch_size": 2, "max_length": 2048, "packing": True}))
    assert a["overrides"]["step"] == {"batch": 2, "seq": 2048, "precision": "fp32"}
    assert not any("--seq" in n or "padded" in n for n in a["notes"])


def test_deepspeed_inside(tmp_path):
    # integrations/deepspeed.py, trainer_config_process: "auto" takes the Trainer's values; DeepSpeed's
    # bf16 keeps fp32 master weights (mixed-bf16), not autocast
    ds = {"zero_optimization": {"stage": 3}, "bf16": {"enabled": "auto"}, "train_micro_batch_size_per_gpu": "auto"}
    a = read_hf_args(written(tmp_path, {"per_device_train_batch_size": 4, "bf16": True, "deepspeed": ds}))
    assert a["overrides"] == {"step": {"batch": 4, "precision": "mixed-bf16"}, "parallel": {"zero": 3}}
    assert any("filled from these arguments" in n for n in a["notes"])
    with pytest.raises(ConfigError, match="step.batch: 8 from deepspeed but 4 from hf-args"):
        read_hf_args(written(tmp_path, {"per_device_train_batch_size": 4,
                                        "deepspeed": {"train_micro_batch_size_per_gpu": 8}}))


def test_fsdp(tmp_path):
    # training_args.py, _apply_legacy_fsdp_to_config: shard_grad_op keeps the gathered parameters
    a = read_hf_args(written(tmp_path, {"fsdp": "shard_grad_op auto_wrap offload"}))
    assert a["overrides"]["parallel"] == {"fsdp": "full", "reshard_after_forward": False,
                                          "offload": ("optimizer", "params")}
    with pytest.raises(ConfigError, match="fsdp='hybrid_shard'"):
        read_hf_args(written(tmp_path, {"fsdp": ["hybrid_shard"]}))


@pytest.mark.parametrize("d, message", [
    ({"per_device_train_batch_sise": 4},
     "unknown key 'per_device_train_batch_sise' (did you mean 'per_device_train_batch_size'?)"),
    ({"per_device_train_batch_size": 0}, "per_device_train_batch_size=0 must be positive"),
    ({"bf16": "yes"}, "bf16='yes' must be bool"),
    ({"bf16": True, "fp16": True}, "bf16 and fp16 are both true"),
    ([{"bf16": True}], "expected a JSON object, got a list"),
])
def test_bad_input(tmp_path, d, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        read_hf_args(written(tmp_path, d))


def test_cli_precedence_and_notes(tmp_path, capsys):
    path = args_file(tmp_path, per_device_train_batch_size=4, bf16=True, optim="paged_adamw_8bit")
    assert main(["estimate", "--model", "gpt2", "--hf-args", path, "--batch", "2", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["inputs"]["files"]["overridden_by_command_line"] == ["step.batch"]
    assert out["inputs"]["step"]["batch"] == 2 and out["inputs"]["step"]["precision"] == "hf-bf16"
    assert out["inputs"]["step"]["precision_recipe"] == "amp-bf16"
    assert main(["estimate", "--model", "gpt2", "--hf-args", path, "--summary"]) == 0
    text = capsys.readouterr().out
    assert f"from {path}:" in text and "bf16=True: autocast over fp32 weights assumed (hf-bf16 = amp-bf16)" in text
    assert " hf-bf16 " in text.splitlines()[0]  # the summary's header names the alias the note explains
    assert "--seq (default 4096" in text


def test_notes_of_other_readers_reach_the_text(tmp_path, capsys):
    # issue 15: a DeepSpeed file whose precision is "auto" says so in the text output, not only in --json
    p = tmp_path / "ds.json"
    p.write_text('{"bf16": {"enabled": "auto"}, "zero_optimization": {"stage": 2}}')
    assert main(["estimate", "--model", "gpt2", "--deepspeed", str(p), "--summary"]) == 0
    assert f'from {p}:\n  - bf16.enabled is "auto"' in capsys.readouterr().out
