"""command line > files > defaults, conflicts between files, and specs built from the result."""

from __future__ import annotations

import argparse
import json

import pytest

from trainmem.cliargs import add_model_step_args
from trainmem.errors import ConfigError
from trainmem.inputs import add_input_args, apply_inputs, model_from_args, spec_fields
from trainmem.specs.loaders import load_model


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_model_step_args(p)
    p.add_argument("--tp", type=int, default=1)  # a parallel option, as the estimate command will have
    add_input_args(p)
    args = p.parse_args(argv)
    args.inputs = apply_inputs(args, p)
    return args


@pytest.fixture
def config(tmp_path):
    p = tmp_path / "run.toml"
    p.write_text('[model]\nname = "gpt2"\n[step]\nbatch = 4\nseq = 512\n[impl]\nattention = "eager"\n'
                 'fused_norm = true\n[parallel]\ntp = 2\nzero = 1\n')
    return str(p)


def test_defaults_without_files():
    args = parse([])
    # --seq defaults to None: 4096, or the model's learned positions when fewer (resolved with the model);
    # --attention to None: the family's default kernel (cliargs.resolve_attention), sdpa for llama
    assert (args.model, args.batch, args.seq, args.attention, args.tp) == ("llama-3-8b", 1, None, None, 1)
    from trainmem.cliargs import resolve_attention
    resolve_attention(args, "llama")
    assert args.attention == "sdpa"
    assert args.inputs == {} and args.spec_overrides == {}


def test_file_over_defaults(config):
    args = parse(["--config", config])
    assert (args.model, args.batch, args.seq, args.attention, args.tp) == ("gpt2", 4, 512, "eager", 2)
    # fields without an option go to the specs directly
    assert spec_fields(args, "impl") == {"fused_norm": True}
    assert spec_fields(args, "parallel") == {"zero": 1}
    assert args.inputs["applied"]["step.batch"] == "config"
    json.dumps(args.inputs)  # the JSON ``inputs`` can carry it


def test_command_line_over_file(config):
    # typing the default value still counts as typed
    args = parse(["--config", config, "--batch", "1", "--tp", "1", "--model", "gpt2-xl"])
    assert (args.model, args.batch, args.seq, args.tp) == ("gpt2-xl", 1, 512, 1)
    assert set(args.inputs["overridden_by_command_line"]) == {"step.batch", "parallel.tp", "model.name"}


def test_files_that_disagree_are_an_error(config, tmp_path):
    ds = tmp_path / "ds.json"
    ds.write_text('{"train_micro_batch_size_per_gpu": 8, "bf16": {"enabled": true}}')
    with pytest.raises(ConfigError, match=r"step.batch: 4 from config but 8 from deepspeed"):
        parse(["--config", config, "--deepspeed", str(ds)])
    ds.write_text('{"train_micro_batch_size_per_gpu": 4, "bf16": {"enabled": true}}')
    args = parse(["--config", config, "--deepspeed", str(ds)])
    assert args.precision == "mixed-bf16" and args.inputs["applied"]["step.precision"] == "deepspeed"
    assert set(args.inputs) == {"config", "deepspeed", "applied", "overridden_by_command_line"}


def test_model_fields_from_megatron_build_a_whole_model():
    args = parse(["--megatron-args", "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --vocab-size 100 "
                                     "--swiglu --normalization RMSNorm --position-embedding-type rope"])
    m = model_from_args(args)
    assert (m.name, m.family, m.num_layers, m.hidden_size, m.head_dim, m.ffn_size, m.vocab_size) == (
        "custom", "generic", 2, 64, 16, 256, 100)


def test_model_fields_on_top_of_a_preset(tmp_path):
    p = tmp_path / "m.toml"
    p.write_text('[model]\nname = "llama-2-7b"\nnum_layers = 4\nhidden_size = 1024\nnum_heads = 8\n')
    args = parse(["--config", str(p)])
    m = model_from_args(args)
    base = load_model("llama-2-7b")
    assert (m.num_layers, m.hidden_size, m.num_heads, m.num_kv_heads, m.head_dim) == (4, 1024, 8, 8, 128)
    assert (m.ffn_size, m.vocab_size) == (base.ffn_size, base.vocab_size)
    # a model typed on the command line replaces the files' model entirely
    args = parse(["--config", str(p), "--model", "gpt2"])
    assert model_from_args(args) == load_model("gpt2")


def test_help_shows_plain_defaults():
    p = argparse.ArgumentParser()
    p.add_argument("--batch", type=int, default=1, help="B (default %(default)s)")
    add_input_args(p)
    assert "B (default 1)" in p.format_help()


def test_options_with_other_names_and_comma_lists(tmp_path):
    p = argparse.ArgumentParser()
    add_model_step_args(p)
    p.add_argument("--offload", default="")
    p.add_argument("--no-reshard-after-forward", action="store_true")
    add_input_args(p)
    cfg = tmp_path / "p.toml"
    cfg.write_text('[parallel]\noffload = ["optimizer", "params"]\nreshard_after_forward = false\n')
    args = p.parse_args(["--config", str(cfg)])
    apply_inputs(args, p)
    assert args.offload == "optimizer,params" and args.no_reshard_after_forward is True
