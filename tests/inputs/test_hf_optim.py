"""TrainingArguments ``optim``: every transformers 5.24 ``OptimizerNames`` value is either modelled
(the optimizer the Trainer builds, read as a live one would be) or refused in one line naming it.

The modelled names are checked against what the Trainer really builds: transformers'
``Trainer.get_optimizer_cls_and_kwargs`` (``trainer_optimizer.py``'s handler for the name) gives the
class and keywords, the optimizer is built on a tensor and read by ``integrations/read.optimizer_of``,
which must agree with ``trainer_optim_of`` (the reading before the Trainer builds it).
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

transformers = pytest.importorskip("transformers")

from trainmem.errors import ConfigError, UnsupportedError  # noqa: E402
from trainmem.inputs.hf_args import read_hf_args  # noqa: E402
from trainmem.integrations.read import (TRAINER_OPTIMS, UNMODELLED_TRAINER_OPTIMS, optimizer_of,  # noqa: E402
                                        trainer_optim_of)
from trainmem.specs.step import OPTIMIZERS  # noqa: E402

NAMES = [o.value for o in transformers.training_args.OptimizerNames]


def _written(tmp_path, d) -> str:
    p = tmp_path / "args.json"
    p.write_text(json.dumps(d))
    return str(p)


def test_every_optimizer_name_is_modelled_or_refused():
    assert set(TRAINER_OPTIMS) | set(UNMODELLED_TRAINER_OPTIMS) == set(NAMES)
    assert not set(TRAINER_OPTIMS) & set(UNMODELLED_TRAINER_OPTIMS)
    from trainmem.integrations.read import OPTIMIZER_CLASSES
    assert {OPTIMIZER_CLASSES[c][0] for c in TRAINER_OPTIMS.values() if c != "SGD"} <= set(OPTIMIZERS)


@pytest.mark.parametrize("optim", sorted(TRAINER_OPTIMS))
def test_what_the_trainer_builds_is_read_alike(optim, tmp_path):
    torch = pytest.importorskip("torch")
    if "bnb" in optim or "lion" in optim or "8bit" in optim or "32bit" in optim or "ademamix" in optim:
        pytest.importorskip("bitsandbytes")
    if optim.startswith("adamw_torch_") and optim.endswith("bit"):
        pytest.importorskip("torchao")
    args = transformers.TrainingArguments(output_dir=str(tmp_path), optim=optim, use_cpu=True)
    cls, kwargs = transformers.Trainer.get_optimizer_cls_and_kwargs(args)
    built = cls([torch.nn.Parameter(torch.zeros(8))], **kwargs)
    for device in ("cpu", "cuda"):
        assert optimizer_of(built, device=device).value == trainer_optim_of(optim, None, device=device).value


@pytest.mark.parametrize("optim", sorted(UNMODELLED_TRAINER_OPTIMS))
def test_unmodelled_names_are_refused_naming_optim(optim, tmp_path):
    with pytest.raises(ConfigError, match=f"optim='{optim}' is not modelled: "):
        read_hf_args(_written(tmp_path, {"optim": optim}))
    with pytest.raises(UnsupportedError, match=f"optim='{optim}'"):
        trainer_optim_of(optim, None, device="cuda")


def test_a_name_transformers_lacks_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="optim='lion' is not a transformers optimizer name"):
        read_hf_args(_written(tmp_path, {"optim": "lion"}))


@pytest.mark.parametrize("d, optimizer", [
    ({"optim": "sgd", "optim_args": "momentum=0.9,dampening=0.1"}, "sgd-momentum"),  # dampening: in place
    ({"optim": "adamw_torch", "weight_decay": 0.1}, "adamw"),  # AdamW decays in place (mul_)
    ({"optim": "lion_8bit", "weight_decay": 0.1}, "lion8bit"),  # bitsandbytes: inside its kernel
    ({"optim": "adagrad", "optim_args": "lr_decay=0.01,eps=1e-6"}, "adagrad"),
    ({"optim": "rmsprop_bnb_8bit", "optim_args": "momentum=0.9"}, "rmsprop8bit"),  # one state whatever momentum
    # Trainer.create_optimizer's param groups carry args.weight_decay (0 here), overriding optim_args'
    ({"optim": "sgd", "optim_args": "weight_decay=0.01"}, "sgd"),
])
def test_settings_that_keep_the_layout(tmp_path, d, optimizer):
    a = read_hf_args(_written(tmp_path, d))
    assert a["overrides"]["step"]["optimizer"] == optimizer


@pytest.mark.parametrize("d, needle", [
    # torch/optim/sgd.py, _single_tensor_sgd: grad = grad.add(param, alpha=weight_decay), out of place
    ({"optim": "sgd", "weight_decay": 0.01}, "optim='sgd' with weight_decay=0.01"),
    ({"optim": "sgd", "optim_args": "momentum=0.9,nesterov=True"}, "optim='sgd' with nesterov=True"),
    ({"optim": "adagrad", "weight_decay": 0.1}, "optim='adagrad' with weight_decay=0.1"),
    ({"optim": "rmsprop", "optim_args": "momentum=0.9"}, "optim='rmsprop' with momentum=0.9"),  # momentum_buffer
    ({"optim": "rmsprop", "optim_args": "centered=True"}, "optim='rmsprop' with centered=True"),  # grad_avg
    ({"optim": "sgd", "optim_args": "momentum=lots"}, "momentum must be a number"),
])
def test_torch_settings_not_modelled_are_refused(tmp_path, d, needle):
    with pytest.raises(ConfigError, match=None) as err:
        read_hf_args(_written(tmp_path, d))
    assert needle in str(err.value)


def test_the_live_optimizer_with_weight_decay_is_refused():
    torch = pytest.importorskip("torch")
    p = torch.nn.Parameter(torch.zeros(8))
    opt = torch.optim.SGD([{"params": [p], "weight_decay": 0.01}], lr=1e-3)  # the Trainer's decay group
    with pytest.raises(UnsupportedError, match="weight_decay=0.01"):
        optimizer_of(opt, device="cuda")
    assert optimizer_of(torch.optim.RMSprop([p]), device="cuda").value == ("rmsprop", "foreach")
    assert optimizer_of(torch.optim.Adagrad([p], fused=True), device="cpu").value == ("adagrad", "fused")


def test_cli_refuses_in_one_line(tmp_path):
    path = _written(tmp_path, {"optim": "galore_adamw", "optim_target_modules": ["q_proj"]})
    proc = subprocess.run([sys.executable, "-m", "trainmem.cli", "estimate", "--model", "gpt2", "--seq", "64",
                           "--hf-args", path], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "optim='galore_adamw' is not modelled" in lines[0], proc.stderr


def test_cli_estimates_lion(tmp_path):
    path = _written(tmp_path, {"optim": "paged_lion_8bit"})
    proc = subprocess.run([sys.executable, "-m", "trainmem.cli", "estimate", "--model", "gpt2", "--seq", "64",
                           "--hf-args", path], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "optimizer=paged-lion8bit" in proc.stdout
    assert "paged 8-bit blockwise optimizer states (paged-lion8bit)" in proc.stdout


def test_ademamix32bit_class_is_not_read_as_transformers_ademamix():
    """transformers builds ``AdEMAMix(optim_bits=32)``: state1 holds both momenta. bitsandbytes'
    ``AdEMAMix32bit`` is an ``Optimizer2State`` with Adam's layout: refused, not read as the other."""
    torch = pytest.importorskip("torch")
    bnb = pytest.importorskip("bitsandbytes")
    p = [torch.nn.Parameter(torch.zeros(8))]
    assert optimizer_of(bnb.optim.AdEMAMix(p), device="cuda").value == ("ademamix", "auto")
    assert optimizer_of(bnb.optim.AdEMAMix8bit(p), device="cuda").value == ("ademamix8bit", "auto")
    with pytest.raises(UnsupportedError, match="AdEMAMix32bit"):
        optimizer_of(bnb.optim.AdEMAMix32bit(p), device="cuda")


@pytest.mark.parametrize("kwargs", [
    {"optim": "sgd", "optim_args": "weight_decay=0.01"},  # the groups' 0.0 overrides the defaults' 0.01
    {"optim": "sgd", "optim_args": "momentum=0.9", "weight_decay": 0.01},  # the decay group's 0.01: refused
    {"optim": "adagrad"}, {"optim": "rmsprop", "optim_args": "centered=True"}, {"optim": "lion_8bit"},
])
def test_the_trainers_own_optimizer_reads_as_its_arguments(kwargs, tmp_path):
    """Trainer.create_optimizer (param groups with weight_decay) builds the optimizer; reading it live
    and reading the arguments give the same answer, or the same refusal."""
    pytest.importorskip("torch")
    if "lion" in kwargs["optim"]:
        pytest.importorskip("bitsandbytes")
    from trainmem.models.hf import build_hf_model
    model = build_hf_model(dict(model_type="llama", hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                num_attention_heads=2, num_key_value_heads=1, vocab_size=64), attention="sdpa")
    args = transformers.TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[], **kwargs)
    optimizer = transformers.Trainer(model=model, args=args).create_optimizer()
    answers = []
    for read in (lambda: optimizer_of(optimizer, device="cuda"),
                 lambda: trainer_optim_of(args.optim, args.optim_args, device="cuda", weight_decay=args.weight_decay)):
        try:
            answers.append(read().value)
        except UnsupportedError as e:
            answers.append(str(e).split(" with ")[1].split(":")[0])  # the setting refused, e.g. weight_decay=0.01
    assert answers[0] == answers[1]
