"""torchtune's ``optimizer:`` section (inputs/torchtune_optim.py): each class and keyword read as
the optimizer torchtune would build runs, checked against that real optimizer, read live by
integrations/read.py ``optimizer_of``; an optimizer or keyword not modelled is one ConfigError."""

from __future__ import annotations

import importlib

import pytest

from trainmem.cli import main
from trainmem.errors import ConfigError, UnsupportedError
from trainmem.inputs import read_torchtune


MODEL = "model:\n  _component_: torchtune.models.llama3.llama3_8b\n"


def read(tmp_path, optimizer: dict) -> dict:
    lines = "".join(f"  {k}: {v}\n" for k, v in optimizer.items())
    p = tmp_path / "recipe.yaml"
    p.write_text(f"{MODEL}optimizer:\n{lines}")
    return read_torchtune(p)["overrides"]


#: optimizer section -> (--optimizer, --optimizer-impl or None)
READ = [
    ({"_component_": "torch.optim.AdamW", "lr": 2e-5, "fused": True, "weight_decay": 0.01}, ("adamw", "fused")),
    ({"_component_": "torch.optim.Adam", "foreach": False}, ("adam", "for-loop")),
    ({"_component_": "torch.optim.SGD", "momentum": 0.9}, ("sgd-momentum", None)),
    ({"_component_": "torch.optim.SGD", "lr": 0.1}, ("sgd", None)),
    ({"_component_": "torch.optim.RMSprop", "foreach": True}, ("rmsprop", "foreach")),
    ({"_component_": "torch.optim.Adagrad", "fused": True}, ("adagrad", "fused")),
    ({"_component_": "bitsandbytes.optim.AdamW8bit", "weight_decay": 0.01}, ("adamw8bit", None)),
    ({"_component_": "bitsandbytes.optim.AdamW8bit", "is_paged": True}, ("paged-adamw8bit", None)),
    ({"_component_": "bitsandbytes.optim.Adam8bit"}, ("adam8bit", None)),
    ({"_component_": "bitsandbytes.optim.PagedAdamW8bit"}, ("paged-adamw8bit", None)),
    ({"_component_": "bitsandbytes.optim.PagedAdamW"}, ("paged-adamw32bit", None)),
    ({"_component_": "bitsandbytes.optim.PagedAdamW32bit"}, ("paged-adamw32bit", None)),
    ({"_component_": "bitsandbytes.optim.Lion"}, ("lion32bit", None)),
    ({"_component_": "bitsandbytes.optim.Lion", "optim_bits": 8, "is_paged": True}, ("paged-lion8bit", None)),
    ({"_component_": "bitsandbytes.optim.Lion8bit", "weight_decay": 0.1}, ("lion8bit", None)),
    ({"_component_": "bitsandbytes.optim.Lion32bit"}, ("lion32bit", None)),
    ({"_component_": "bitsandbytes.optim.PagedLion8bit"}, ("paged-lion8bit", None)),
    ({"_component_": "bitsandbytes.optim.PagedLion32bit"}, ("paged-lion32bit", None)),
    ({"_component_": "bitsandbytes.optim.PagedLion"}, ("paged-lion32bit", None)),
    ({"_component_": "bitsandbytes.optim.RMSprop"}, ("rmsprop32bit", None)),
    ({"_component_": "bitsandbytes.optim.RMSprop", "optim_bits": 8}, ("rmsprop8bit", None)),
    ({"_component_": "bitsandbytes.optim.RMSprop8bit"}, ("rmsprop8bit", None)),
    ({"_component_": "bitsandbytes.optim.RMSprop32bit"}, ("rmsprop32bit", None)),
    ({"_component_": "bitsandbytes.optim.AdEMAMix"}, ("ademamix", None)),
    ({"_component_": "bitsandbytes.optim.AdEMAMix", "optim_bits": 8}, ("ademamix8bit", None)),
    ({"_component_": "bitsandbytes.optim.AdEMAMix8bit"}, ("ademamix8bit", None)),
    ({"_component_": "torchao.optim.AdamW8bit"}, ("torchao-adamw8bit", None)),
    ({"_component_": "torchao.optim.AdamW4bit"}, ("torchao-adamw4bit", None)),
    ({"_component_": "torchao.optim.AdamW4bit", "block_size": 256}, ("torchao-adamw4bit-block256", None)),
    ({"_component_": "torchao.optim.AdamW8bit", "block_size": 256}, ("torchao-adamw8bit", None)),
    ({"_component_": "torchao.prototype.low_bit_optim.AdamW8bit"}, ("torchao-adamw8bit", None)),
]

#: optimizer section -> what the one-line error says
REFUSED = [
    ({"_component_": "torch.optim.NAdam"}, "optimizer._component_='torch.optim.NAdam' is not modelled"),
    ({"_component_": "torchtune.training.SomethingElse"}, "'torchtune.training.SomethingElse' is not modelled"),
    ({"_component_": "torch.optim.SGD", "weight_decay": 0.01}, "with weight_decay=0.01: torch's SGD"),
    ({"_component_": "torch.optim.SGD", "momentum": 0.9, "nesterov": True}, "with nesterov=True"),
    ({"_component_": "torch.optim.RMSprop", "momentum": 0.9}, "with momentum=0.9: torch's RMSprop then holds a state"),
    ({"_component_": "torch.optim.RMSprop", "centered": True}, "with centered=True"),
    ({"_component_": "torch.optim.Adagrad", "weight_decay": 0.1}, "with weight_decay=0.1: torch's Adagrad"),
    ({"_component_": "torch.optim.AdamW", "amsgrad": True}, "with amsgrad=True: torch's AdamW then holds a state"),
    ({"_component_": "torch.optim.Adam", "maximize": True}, "with maximize=True: torch's Adam then holds a gradient"),
    ({"_component_": "torch.optim.Adam", "weight_decay": 0.1}, "with weight_decay=0.1: torch's Adam then holds a gra"),
    ({"_component_": "bitsandbytes.optim.AdamW"}, "'bitsandbytes.optim.AdamW' (optim_bits=32, is_paged=False) is not"),
    ({"_component_": "bitsandbytes.optim.Adam", "optim_bits": 8, "is_paged": True}, "(optim_bits=8, is_paged=True)"),
    ({"_component_": "bitsandbytes.optim.AdEMAMix", "is_paged": True}, "(optim_bits=32, is_paged=True) is not"),
    ({"_component_": "bitsandbytes.optim.PagedAdEMAMix8bit"}, "'bitsandbytes.optim.PagedAdEMAMix8bit' (optim_bits=8"),
    ({"_component_": "bitsandbytes.optim.AdEMAMix32bit"}, "an Optimizer2State with Adam's layout"),
    ({"_component_": "bitsandbytes.optim.Lion8bit", "min_8bit_size": 16384}, "optimizer.min_8bit_size=16384"),
    ({"_component_": "torchao.optim.AdamWFp8"}, "'torchao.optim.AdamWFp8' is not modelled"),
    ({"_component_": "torchao.optim.AdamW4bit", "block_size": 64}, "optimizer.block_size=64 is not modelled"),
    ({"_component_": "torchao.optim.AdamW8bit", "amsgrad": True}, "torchao's AdamW8bit then holds a max_exp_avg_sq"),
]


@pytest.mark.parametrize("section, expected", READ, ids=lambda x: str(x)[:60])
def test_read(tmp_path, section, expected):
    o = read(tmp_path, section)
    assert (o["step"]["optimizer"], o.get("impl", {}).get("optimizer_impl")) == expected


@pytest.mark.parametrize("section, message", REFUSED, ids=lambda x: str(x)[:60])
def test_refused(tmp_path, section, message):
    with pytest.raises(ConfigError, match="optimizer") as e:
        read(tmp_path, section)
    assert message in str(e.value) and "\n" not in str(e.value)


def _instantiate(section: dict):
    """What torchtune's config.instantiate(cfg.optimizer, params) builds, on one CPU parameter of
    8192 values (8-bit states from 4096 on)."""
    import torch
    module, _, cls = section["_component_"].rpartition(".")
    try:
        lib = importlib.import_module(module)
    except ImportError as e:
        pytest.skip(f"{module}: {e}")
    kwargs = {k: v for k, v in section.items() if k != "_component_"}
    return getattr(lib, cls)([torch.nn.Parameter(torch.zeros(64, 128))], **kwargs)


@pytest.mark.parametrize("section, expected", READ, ids=lambda x: str(x)[:60])
def test_the_real_optimizer_reads_alike(section, expected):
    from trainmem.integrations.read import optimizer_of
    if section["_component_"].startswith("torchao.prototype"):
        pytest.skip("torchao >= 0.11 has no prototype.low_bit_optim")
    name, _ = optimizer_of(_instantiate(section), device="cpu").value
    assert name == expected[0]


@pytest.mark.parametrize("section", [s for s, _ in REFUSED if s["_component_"].startswith(("torch.optim.S",
                         "torch.optim.R", "torch.optim.Adagrad", "bitsandbytes.optim.A"))], ids=lambda x: str(x)[:60])
def test_the_real_optimizer_is_refused_live_too(section):
    from trainmem.integrations.read import optimizer_of
    try:
        opt = _instantiate(section)
    except (NotImplementedError, TypeError) as e:  # bitsandbytes refuses it itself
        pytest.skip(str(e))
    with pytest.raises(UnsupportedError):
        optimizer_of(opt, device="cpu")


def test_cli_one_line_exit_2(tmp_path, capsys):
    p = tmp_path / "recipe.yaml"
    p.write_text(f"{MODEL}optimizer:\n  _component_: torch.optim.NAdam\n  lr: 1e-4\n")
    assert main(["estimate", "--torchtune", str(p)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "optimizer._component_='torch.optim.NAdam' is not modelled" in err
