"""TP loss parallel (estimate/loss_parallel.py): the loss's items and phases per rank, the flag,
torchtitan's ``disable_loss_parallel`` and advise's choice. The torchrun checks against real
DTensor TP runs are tests/parallel/test_loss_parallel_dist.py (slow)."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from trainmem.cli import main
from trainmem.errors import SpecError
from trainmem.estimate import estimate
from trainmem.inputs import read_torchtitan
from trainmem.measure_dist.worker import DEFAULTS
from trainmem.specs import ImplSpec, ParallelSpec, StepSpec
from trainmem.specs.loaders import spec_from_hf_config

MODEL = spec_from_hf_config(DEFAULTS["config"])  # the torchrun workers' tiny Llama, V = 256
STEP = StepSpec(batch=2, seq=64, precision="fp32", optimizer="adamw")
IMPL = ImplSpec(device="cpu", attention="sdpa", optimizer_impl="foreach")


def _rank(par: ParallelSpec, model=MODEL, step=STEP, impl=IMPL):
    return estimate(model, step, impl, parallel=par).ranks[0]


def _loss_items(result) -> dict[str, tuple]:
    return {i.name: (i.shape, i.dtype, i.bytes) for i in result.inventory.items if i.name.startswith("loss.")}


def _single_loss_items(model) -> dict[str, tuple]:
    return {i.name: (i.shape, i.dtype, i.bytes) for i in estimate(model, STEP, IMPL).inventory.items
            if i.name.startswith("loss.")}


@pytest.mark.parametrize("sp", [False, True])
def test_loss_items_are_vocab_sharded_or_gathered(sp):
    """loss_parallel: the rank's loss items are a single device's over V/tp columns; gathered
    logits: a single device's over the full vocabulary (the head's weight stays sharded)."""
    on = _rank(ParallelSpec(tp=2, sp=sp))
    off = _rank(ParallelSpec(tp=2, sp=sp, loss_parallel=False))
    assert _loss_items(on) == _single_loss_items(replace(MODEL, vocab_size=MODEL.vocab_size // 2))
    assert _loss_items(off) == _single_loss_items(MODEL)
    head = [i.bytes for r in (on, off) for i in r.inventory.items if i.name == "lm_head.weight"]
    assert head[0] == head[1] == MODEL.vocab_size // 2 * MODEL.hidden_size * 4


def test_phases_hold_the_loss_temporaries():
    """Sharded: the shifted logits in forward and three B·S·V/tp tensors in the fused backward;
    gathered: the all-gather moment (local shard, gather buffer, concatenated logits)."""
    B, S, V = STEP.batch, STEP.seq, MODEL.vocab_size
    u = B * S * (V // 2) * 4
    on = {p.name: p.parts for p in _rank(ParallelSpec(tp=2)).phases}
    assert on["forward"]["log_softmax_shifted"] == u and on["backward_start"]["logits_grad"] == 3 * u
    off = {p.name: p.parts for p in _rank(ParallelSpec(tp=2, loss_parallel=False)).phases}
    assert off["backward_start"]["logits_grad"] == 2 * B * S * V * 4
    assert off["logits_all_gather"]["logits_gather"] == u + 2 * B * S * V * 4
    assert "log_softmax_shifted" not in off["forward"]
    # one device is unchanged by the flag
    assert _rank(ParallelSpec(dp=2)).peak_bytes == _rank(ParallelSpec(dp=2, loss_parallel=False)).peak_bytes


def test_megatron_refuses_gathered_logits():
    with pytest.raises(SpecError, match="loss_parallel"):
        _rank(ParallelSpec(tp=2, loss_parallel=False), impl=replace(IMPL, profile="megatron"))


def test_flag_and_torchtitan_key(tmp_path, capsys):
    args = ["estimate", "--model", "llama-3-8b", "--batch", "1", "--seq", "2048", "--tp", "8", "--json"]
    assert main(args) == 0
    on = json.loads(capsys.readouterr().out)
    assert main(args + ["--no-loss-parallel"]) == 0
    off = json.loads(capsys.readouterr().out)
    assert (on["inputs"]["parallel"]["loss_parallel"], off["inputs"]["parallel"]["loss_parallel"]) == (True, False)
    assert off["peak_bytes"] > on["peak_bytes"]
    # torchtitan/config/job_config.py, Parallelism.disable_loss_parallel (default False); read only with TP
    job = tmp_path / "job.toml"
    job.write_text("[parallelism]\ndata_parallel_shard_degree = 1\ntensor_parallel_degree = 8\n"
                   "disable_loss_parallel = true\n")
    assert read_torchtitan(job)["overrides"]["parallel"]["loss_parallel"] is False
    assert main(["estimate", "--model", "llama-3-8b", "--torchtitan", str(job), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["inputs"]["parallel"]["loss_parallel"] is False
    job.write_text("[parallelism]\ndata_parallel_shard_degree = 1\ntensor_parallel_degree = 8\n")
    assert "loss_parallel" not in read_torchtitan(job)["overrides"]["parallel"]
    job.write_text("[parallelism]\ntensor_parallel_degree = 8\ndisable_loss_parallel = 1\n")
    assert main(["estimate", "--torchtitan", str(job)]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "disable_loss_parallel" in err


def test_advise_offers_loss_parallel_where_tp():
    from trainmem.plan.choices import CHOICES, Config, Context

    ctx = Context(model=MODEL, gpus=2, gpus_per_node=8)
    off = Config(STEP, IMPL, ParallelSpec(tp=2, loss_parallel=False))
    (variant, action), = CHOICES["loss_parallel"].variants(off, ctx)
    assert variant.par.loss_parallel and "loss_parallel" in action
    assert "--no-loss-parallel" in off.command("m") and "--no-loss-parallel" not in variant.command("m")
    assert not list(CHOICES["loss_parallel"].variants(Config(STEP, IMPL, ParallelSpec(dp=2)), ctx))
