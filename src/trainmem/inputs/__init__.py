"""Inputs people already have: trainmem's TOML config, DeepSpeed JSON, Megatron-LM arguments,
torchtitan TOML, torchtune YAML and Hugging Face TrainingArguments JSON, turned into spec
overrides. (Hugging Face config.json files and model folders are what ``--model`` takes:
:mod:`trainmem.specs.loaders`.)

Precedence is command line > files > defaults. Two files that set one field to different values
are an error naming both. Every reader returns a plain dict (``source``, ``path``, ``raw``,
``overrides``, ``notes``) so the JSON ``inputs`` can show what was read.

Wiring into a command::

    add_model_step_args(p); add_input_args(p)      # add_input_args last: it marks the defaults
    ...
    files = apply_inputs(args, parser)             # before specs_from_args
    model = model_from_args(args)                  # --model plus any model fields from files
    step = StepSpec(..., **spec_fields(args, "step"))
"""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any

from trainmem.errors import ConfigError
from trainmem.inputs._common import merge_overrides
from trainmem.inputs.deepspeed import read_deepspeed
from trainmem.inputs.hf_args import read_hf_args
from trainmem.inputs.megatron import parse_megatron_args
from trainmem.inputs.torchtitan import read_torchtitan
from trainmem.inputs.torchtune import read_torchtune
from trainmem.inputs.trainmem_toml import read_config

__all__ = [
    "add_input_args", "apply_inputs", "model_from_args", "spec_fields",
    "read_config", "read_deepspeed", "parse_megatron_args", "read_torchtitan",
    "read_torchtune", "read_hf_args", "merge_overrides", "file_notes",
]

#: (argparse dest, reader, what the file is) in the order they are read.
SOURCES = (
    ("config", read_config, "trainmem TOML config"),
    ("torchtitan", read_torchtitan, "torchtitan job config"),
    ("torchtune", read_torchtune, "torchtune recipe config"),
    ("hf_args", read_hf_args, "Hugging Face TrainingArguments"),
    ("deepspeed", read_deepspeed, "DeepSpeed config"),
    ("megatron_args", parse_megatron_args, "Megatron-LM arguments"),
)
#: Spec fields whose command-line option has another name: field -> (dest, value conversion).
_OPTION = {("model", "name"): ("model", None), ("finetune", "mode"): ("finetune", None),
           ("parallel", "reshard_after_forward"): ("no_reshard_after_forward", lambda v: not v),
           ("parallel", "loss_parallel"): ("no_loss_parallel", lambda v: not v)}
_REQUIRED_MODEL = ("hidden_size", "num_layers", "num_heads", "ffn_size", "vocab_size")


class _Default:
    """An option's default, marked so that :func:`apply_inputs` can tell it was not typed."""

    __slots__ = ("value",)

    def __init__(self, value: Any) -> None:
        self.value = value

    def __repr__(self) -> str:
        return repr(self.value)

    def __str__(self) -> str:
        return str(self.value)


def add_input_args(parser: argparse.ArgumentParser) -> None:
    """--config, --deepspeed, --megatron-args, --torchtitan, --torchtune, --hf-args. Call it after
    every other option is added: it marks their defaults so that files can fill what the command
    line left out."""
    g = parser.add_argument_group("input files (command line > files > defaults)")
    g.add_argument("--config", metavar="FILE.toml", help="trainmem TOML config: [model] [step] [impl] [parallel]")
    g.add_argument("--deepspeed", metavar="FILE.json", help="DeepSpeed config (ZeRO stage, offload, batch, bf16/fp16)")
    g.add_argument("--megatron-args", metavar="ARGS", help='Megatron-LM arguments, e.g. "--num-layers 32 --bf16"')
    g.add_argument("--torchtitan", metavar="FILE.toml", help="torchtitan job config")
    g.add_argument("--torchtune", metavar="FILE.yaml", help="torchtune recipe config (full, LoRA, QLoRA fine-tuning)")
    g.add_argument("--hf-args", metavar="FILE.json", help="Hugging Face TrainingArguments as JSON (to_dict())")
    own = {name for name, _, _ in SOURCES}
    for action in parser._actions:
        if (action.option_strings and action.dest not in own and action.dest != "help"
                and action.default is not argparse.SUPPRESS and not isinstance(action.default, _Default)):
            action.default = _Default(action.default)


def apply_inputs(args: argparse.Namespace, parser: argparse.ArgumentParser | None = None) -> dict:
    """Read the files named on the command line and fill the options the user did not type.

    Fields with a command-line option (``batch``, ``attention``, ``tp``...) are set on ``args``;
    the others go to ``args.spec_overrides`` (read by :func:`model_from_args` and
    :func:`spec_fields`). A ``--model`` typed on the command line replaces the files' whole
    model. Returns what was read, for the JSON ``inputs`` ({} when no file was given).
    ``parser`` is accepted for symmetry with argparse; the marks on the defaults are enough.
    """
    defaults = {k: v.value for k, v in vars(args).items() if isinstance(v, _Default)}
    given = set(vars(args)) - set(defaults)
    for k, v in defaults.items():
        setattr(args, k, v)
    answers = []
    for dest, reader, _ in SOURCES:
        value = getattr(args, dest, None)
        if value is not None:
            answers.append(reader(value))
    args.spec_overrides = {}
    if not answers:
        return {}
    for a in answers:  # a file that names a model trainmem cannot build needs --model
        if a.get("needs_model") and "model" not in given:
            raise ConfigError(a["needs_model"])
    merged, origin = merge_overrides(answers)
    applied: dict[str, str] = {}  # field -> the source that set it
    overridden: list[str] = []
    for section, values in merged.items():
        for field, value in values.items():
            key = f"{section}.{field}"
            dest, convert = _OPTION.get((section, field), (field, None))
            if convert:
                value = convert(value)
            if isinstance(value, tuple) and isinstance(defaults.get(dest), str):
                value = ",".join(map(str, value))  # options such as --offload take a comma list
            if section == "model" and "model" in given:
                overridden.append(key)
                continue
            if hasattr(args, dest) and (section != "model" or field == "name"):
                if dest in given:
                    overridden.append(key)
                    continue
                setattr(args, dest, value)
            else:
                args.spec_overrides.setdefault(section, {})[field] = value
            applied[key] = origin[key]
    out: dict[str, Any] = {a["source"]: a for a in answers}
    out["applied"] = applied
    out["overridden_by_command_line"] = overridden
    return out


def spec_fields(args: argparse.Namespace, section: str) -> dict:
    """Fields of one spec (``step``, ``impl``, ``parallel``) that files set and no option carries."""
    return dict(getattr(args, "spec_overrides", {}).get(section, {}))


def model_from_args(args: argparse.Namespace):
    """The ModelSpec: ``--model`` with any model fields from files on top. Files that give every
    size (hidden, layers, heads, FFN, vocabulary) describe the whole model and need no ``--model``
    unless one was typed."""
    from trainmem.specs import ModelSpec
    from trainmem.specs.loaders import load_model

    fields = spec_fields(args, "model")
    if not fields:
        return load_model(args.model)
    if all(k in fields for k in _REQUIRED_MODEL):
        return ModelSpec(**{"name": "custom", **fields})
    base = load_model(args.model)
    if ("hidden_size" in fields or "num_heads" in fields) and "head_dim" not in fields:
        fields["head_dim"] = None
    if "num_heads" in fields and "num_kv_heads" not in fields:
        fields["num_kv_heads"] = None
    if "num_experts" in fields and "expert_ffn_size" not in fields:
        fields["expert_ffn_size"] = 0
    return dataclasses.replace(base, **fields)


def file_notes(files: dict) -> list[tuple[str, list[str]]]:
    """(path, notes) of each file read that has notes, for the text output (``apply_inputs``'s answer)."""
    return [(a["path"], a["notes"]) for a in files.values() if isinstance(a, dict) and "source" in a and a["notes"]]
