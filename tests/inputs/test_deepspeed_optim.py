"""DeepSpeed ``optimizer.type``: the names DeepSpeed builds (``engine.py``
``_configure_basic_optimizer``) mapped to trainmem's optimizers, torch's classes read with their
``optimizer.params``, and the types whose memory is not modelled refused in one line."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from trainmem.errors import ConfigError
from trainmem.inputs.deepspeed import read_deepspeed


def _read(tmp_path, optimizer: dict) -> dict:
    p = tmp_path / "ds.json"
    p.write_text(json.dumps({"optimizer": optimizer}))
    return read_deepspeed(str(p))


@pytest.mark.parametrize("optimizer, name", [
    ({"type": "AdamW", "params": {"weight_decay": 0.01}}, "adamw"),  # decoupled: in place
    ({"type": "Lion", "params": {"lr": 1e-4}}, "lion32bit"),  # FusedLion: one fp32 exp_avg per parameter
    ({"type": "Adagrad", "params": {"lr": 1e-2}}, "adagrad"),  # torch.optim.Adagrad (no offload)
    ({"type": "RMSprop", "params": {"alpha": 0.9}}, "rmsprop"),  # getattr(torch.optim, "RMSprop")
    ({"type": "SGD", "params": {"momentum": 0.9}}, "sgd-momentum"),  # a momentum buffer per parameter
    ({"type": "SGD", "params": {"momentum": 0}}, "sgd"),
    ({"type": "SGD", "params": {"weight_decay": "auto"}}, "sgd"),  # "auto": the Trainer's, not read here
    ({"type": "MuAdamW", "params": {}}, "adamw"),  # mup's MuAdamW: torch's AdamW over its parameter groups
])
def test_modelled_types(tmp_path, optimizer, name):
    out = _read(tmp_path, optimizer)
    assert out["overrides"]["step"]["optimizer"] == name
    assert any("FusedLion" in n for n in out["notes"]) == (name == "lion32bit")


@pytest.mark.parametrize("optimizer, needle", [
    ({"type": "Lamb"}, "optimizer.type='Lamb' is not modelled"),
    ({"type": "OneBitAdam"}, "optimizer.type='OneBitAdam' is not modelled: 1-bit compression"),
    ({"type": "Muon"}, "optimizer.type='Muon' is not modelled"),
    ({"type": "NAdam"}, "optimizer.type='NAdam' is not modelled (modelled: "),
    ({"type": "SGD", "params": {"weight_decay": 0.01}}, "optimizer.type='SGD' with weight_decay=0.01"),
    ({"type": "SGD", "params": {"momentum": 0.9, "nesterov": True}}, "optimizer.type='SGD' with nesterov=True"),
    ({"type": "RMSprop", "params": {"momentum": 0.9}}, "optimizer.type='RMSprop' with momentum=0.9"),
    ({"type": "Adagrad", "params": {"weight_decay": 0.1}}, "optimizer.type='Adagrad' with weight_decay=0.1"),
    ({"type": "SGD", "params": [0.9]}, "optimizer.params must be an object"),
])
def test_unmodelled_types_and_settings_are_refused(tmp_path, optimizer, needle):
    with pytest.raises(ConfigError) as err:
        _read(tmp_path, optimizer)
    assert needle in str(err.value)


def test_cli_refuses_in_one_line(tmp_path):
    p = tmp_path / "ds.json"
    p.write_text(json.dumps({"optimizer": {"type": "OneBitLamb"}}))
    proc = subprocess.run([sys.executable, "-m", "trainmem.cli", "estimate", "--model", "gpt2", "--seq", "64",
                           "--deepspeed", str(p)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "optimizer.type='OneBitLamb' is not modelled" in lines[0], proc.stderr
