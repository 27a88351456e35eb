"""TrainMemCallback inside a real Hugging Face Trainer on CPU (tiny Llama h64/L2/V1000, S=128).

The measured step peak is the live-storage meter (trainmem.trace.live) over the first two
optimizer steps; the second is a steady step (optimizer states exist) and sets the peak.
Measured agreement on this project's CPU machine (measured ÷ predicted, 2 steps):
fp32 sdpa 0.9995, amp-bf16 + eager + full checkpointing 0.9992, LoRA r8 on q/v 0.9996,
B=2 × 2 accumulated micro-batches 0.9996.
"""

import logging

import pytest

pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from integrations_tiny import SEQ, Tokens, tiny_llama, training_args  # noqa: E402
from transformers import Trainer  # noqa: E402

import trainmem  # noqa: E402
from trainmem.errors import ConfigError, SpecError, UnsupportedError  # noqa: E402
from trainmem.integrations.hf import (TrainMemCallback, largest_batch_args, parallel_from_trainer,  # noqa: E402
                                      run_from_trainer, seq_from_dataset)
from trainmem.integrations.read import TRAINER_OPTIMS, trainer_optim_of  # noqa: E402
from trainmem.plan.hardware import Reserve  # noqa: E402

TOLERANCE = 0.01  # measured agreement is within 0.1% (module docstring); 1% leaves room across torch builds


def _train(tmp_path, model, callback, **args):
    trainer = Trainer(model=model, args=training_args(tmp_path, **args), train_dataset=Tokens(), callbacks=[callback])
    trainer.train()
    return trainer


def _entries(trainer, key):
    return [e for e in trainer.state.log_history if key in e]


@pytest.mark.parametrize("name, build, args, expect", [
    ("fp32", lambda: tiny_llama(), {}, dict(precision="fp32", attention="sdpa", recompute="none")),
    ("bf16-checkpointed", lambda: tiny_llama("eager"), dict(bf16=True, gradient_checkpointing=True),
     dict(precision="amp-bf16", attention="eager", recompute="full")),
    ("lora", lambda: peft.get_peft_model(tiny_llama(), peft.LoraConfig(r=8, lora_alpha=16,
                                                                       target_modules=["q_proj", "v_proj"])),
     {}, dict(precision="fp32", attention="sdpa", recompute="none")),
    ("accum2", lambda: tiny_llama(), dict(per_device_train_batch_size=2, gradient_accumulation_steps=2),
     dict(precision="fp32", attention="sdpa", recompute="none", batch=2, accum=2)),
])
def test_predicted_and_measured_are_logged_and_agree(tmp_path, caplog, name, build, args, expect):
    cb = TrainMemCallback(gpu="H100-80GB", on_oom="stop")
    with caplog.at_level(logging.INFO, logger="trainmem"):
        trainer = _train(tmp_path, build(), cb, **args)
    assert trainer.state.global_step == 2
    run = cb.report.check.run
    assert (run.step.batch, run.step.seq, run.step.grad_accum) == (expect.get("batch", 4), SEQ, expect.get("accum", 1))
    assert (run.step.precision, run.impl.attention, run.impl.recompute, run.impl.device) == (
        expect["precision"], expect["attention"], expect["recompute"], "cpu")
    assert run.impl.optimizer_impl == "fused"  # the Trainer's default optim, adamw_torch_fused
    if name == "lora":
        ft = run.finetune
        assert (ft.mode, ft.lora_rank, ft.lora_alpha, ft.lora_targets) == ("lora", 8, 16.0, ("q_proj", "v_proj"))
    assert cb.report.check.fits is True
    measured = cb.report.measured
    assert len(measured.step_peaks_bytes) == 2
    ratio = cb.report.ratio
    assert abs(ratio - 1) <= TOLERANCE, f"{name}: measured/predicted = {ratio:.4f}"
    # logged: the trainmem logger ...
    text = caplog.text
    assert "predicted peak" in text and "measured/predicted" in text
    # ... and the Trainer's own log history (trainer_state.json)
    (entry,) = _entries(trainer, "trainmem/measured_peak_bytes")
    assert entry["trainmem/predicted_peak_bytes"] == cb.report.check.predicted_peak_bytes
    assert entry["trainmem/measured_peak_bytes"] == measured.peak_bytes
    assert entry["step"] == 2


def _too_small(tmp_path, model):
    """A device 10% smaller than the predicted reserved peak, under plan/advise's default budget
    (the H100 preset's 1 GiB context, no margin): usable = memory − 1 GiB = 0.9 · reserved."""
    peak = _predicted(tmp_path, model)
    return int(0.9 * peak + (1 << 30)) + 1


def _predicted(tmp_path, model) -> int:
    from trainmem.estimate import estimate
    from trainmem.estimate.allocation_order import estimate_reserved
    run = run_from_trainer(model, training_args(tmp_path), None, train_dataset=Tokens())
    return estimate_reserved(estimate(run.model, run.step, run.impl)).reserved_bytes


def test_a_run_that_does_not_fit_stops_before_its_first_step_with_the_fix(tmp_path, caplog):
    model = tiny_llama("eager")
    cb = TrainMemCallback(gpu_memory=_too_small(tmp_path, model), on_oom="stop")
    trainer = Trainer(model=model, args=training_args(tmp_path), train_dataset=Tokens(), callbacks=[cb])
    with caplog.at_level(logging.INFO, logger="trainmem"), pytest.raises(trainmem.DoesNotFit) as info:
        trainer.train()
    assert trainer.state.global_step == 0
    assert len(trainer.optimizer.state) == 0  # no optimizer step ran
    assert all(p.grad is None for p in model.parameters())  # nor a backward
    check = info.value.check
    assert check.fits is False and check.advice is not None and check.advice.steps
    fix = check.advice.steps[0].action
    assert fix.startswith("attention eager → mem-efficient")  # the ladder's first rung on an eager model
    assert "does NOT fit" in str(info.value) and fix in str(info.value)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("cheapest fix" in m for m in warnings) and any(fix in m for m in warnings)
    assert cb.report.measured is None


def test_warn_mode_trains_on_and_warns(tmp_path, caplog):
    model = tiny_llama()
    cb = TrainMemCallback(gpu_memory=_too_small(tmp_path, model), on_oom="warn", measure_steps=1)
    with caplog.at_level(logging.INFO, logger="trainmem"):
        trainer = _train(tmp_path, model, cb, max_steps=1)
    assert trainer.state.global_step == 1
    assert any("does NOT fit" in r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)
    assert len(cb.report.measured.step_peaks_bytes) == 1


def test_largest_batch_args_sets_the_predicted_micro_batch(tmp_path):
    model = tiny_llama()
    args = training_args(tmp_path)
    new, fit = largest_batch_args(args, model, train_dataset=Tokens(), gpu_memory="1.5GiB")
    assert args.per_device_train_batch_size == 4  # the original is untouched
    assert new.per_device_train_batch_size == fit.batch
    assert fit.reserved_bytes <= fit.budget.usable_bytes < fit.next_reserved_bytes
    with pytest.raises(ConfigError, match="per_device_train_batch_size"):
        largest_batch_args(args, model, train_dataset=Tokens(), gpu_memory="1GiB")  # usable 0: all context


def test_bad_options_name_the_field():
    for kw, field in [(dict(on_oom="explode"), "on_oom"), (dict(tolerance=-1), "tolerance"),
                      (dict(measure_steps=0), "measure_steps"), (dict(gpu_memory="lots"), "gpu_memory"),
                      (dict(gpu="H900"), "gpu"), (dict(seq=0), "seq"),
                      (dict(reserve=0.05), "reserve"), (dict(measure_steps=True), "measure_steps")]:
        with pytest.raises(SpecError) as info:
            TrainMemCallback(**kw)
        assert info.value.field == field


def test_seq_must_be_readable_or_given():
    with pytest.raises(ConfigError, match="seq"):
        seq_from_dataset(iter([]))
    assert seq_from_dataset(Tokens(seq=96)) == 96


@pytest.mark.parametrize("optim, name, on_cpu, on_cuda, note", [
    # torch's default without foreach/fused: the per-tensor loop on CPU, foreach on CUDA
    ("adamw_torch", "adamw", "for-loop", "foreach", None), ("adamw_torch_fused", "adamw", "fused", "fused", None),
    ("sgd", "sgd", "for-loop", "foreach", None),
    # one implementation (bitsandbytes, transformers' Adafactor): the estimate resolves "auto"
    ("adamw_bnb_8bit", "adamw8bit", "auto", "auto", None), ("adamw_8bit", "adamw8bit", "auto", "auto", None),
    ("paged_adamw_8bit", "paged-adamw8bit", "auto", "auto", None),
    ("paged_adamw_32bit", "paged-adamw32bit", "auto", "auto", None),
    # torchao (trainer_optimizer.py, _get_torchao_optimizer): its compiled per-parameter step
    ("adamw_torch_8bit", "torchao-adamw8bit", "auto", "auto", None),
    ("adamw_torch_4bit", "torchao-adamw4bit-block256", "auto", "auto", None),  # block_size=256
    ("adafactor", "adafactor", "auto", "auto", None),
])
def test_trainer_optim_names(optim, name, on_cpu, on_cuda, note):
    read = trainer_optim_of(optim, None, device="cpu")
    assert read.value == (name, on_cpu)
    assert trainer_optim_of(optim, None, device="cuda").value == (name, on_cuda)
    assert (note is None) == (not read.notes) and (note is None or note in " ".join(read.notes))
    assert optim in TRAINER_OPTIMS


@pytest.mark.parametrize("kwargs, on_cpu, on_cuda", [
    ({}, "for-loop", "foreach"), ({"foreach": True}, "foreach", "foreach"),
    ({"foreach": False}, "for-loop", "for-loop"), ({"fused": True}, "fused", "fused"),
])
def test_live_optimizer_implementation(kwargs, on_cpu, on_cuda):
    """Read off the built optimizer's ``defaults`` (what ``step()`` will run), not its class alone."""
    import torch

    from trainmem.integrations.read import optimizer_of
    opt = torch.optim.AdamW(torch.nn.Linear(4, 4).parameters(), lr=1e-3, **kwargs)
    assert optimizer_of(opt, device="cpu").value == ("adamw", on_cpu)
    assert optimizer_of(opt, device="cuda").value == ("adamw", on_cuda)
    assert not optimizer_of(opt, device="cpu").notes


def test_trainer_optim_unknown_and_momentum():
    assert trainer_optim_of("sgd", "momentum=0.9", device="cuda").value == ("sgd-momentum", "foreach")
    # nesterov's grad.add(buf) and galore's projections are not modelled: refused (tests/inputs/test_hf_optim.py)
    for optim, args in (("sgd", "momentum=0.9,nesterov=True"), ("galore_adamw", None)):
        with pytest.raises(UnsupportedError, match=f"optim='{optim}'"):
            trainer_optim_of(optim, args, device="cuda")


def test_parallel_from_deepspeed_and_fsdp():
    ds = {"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}}, "bf16": {"enabled": "auto"},
          "train_micro_batch_size_per_gpu": "auto"}
    par, step, notes = parallel_from_trainer(world_size=8, deepspeed=ds)
    assert (par.dp, par.zero, par.offload) == (8, 3, ("optimizer",))
    assert step == {} and any("auto" in n for n in notes)
    par, _, _ = parallel_from_trainer(world_size=4, fsdp=True, fsdp_config={"reshard_after_forward": True})
    assert (par.dp, par.fsdp, par.reshard_after_forward) == (4, "full", True)
    for keep in (False, "shard_grad_op"):  # FSDP2's bool, FSDP1's strategy
        par, _, _ = parallel_from_trainer(world_size=4, fsdp=True, fsdp_config={"reshard_after_forward": keep})
        assert (par.fsdp, par.reshard_after_forward) == ("full", False)
    with pytest.raises(UnsupportedError, match="hybrid"):
        parallel_from_trainer(world_size=4, fsdp=True, fsdp_config={"reshard_after_forward": "hybrid_shard"})
    par, _, notes = parallel_from_trainer(world_size=2, fsdp=True, fsdp_config={"cpu_offload": True})
    assert par.offload == ("params", "optimizer") and notes


def test_unmodelled_run_is_skipped_with_a_warning(tmp_path, caplog):
    import torch
    model = tiny_llama()

    class Lion(torch.optim.SGD):  # any optimizer class trainmem does not model
        pass

    cb = TrainMemCallback(gpu="H100-80GB")
    trainer = Trainer(model=model, args=training_args(tmp_path, max_steps=1), train_dataset=Tokens(),
                      callbacks=[cb], optimizers=(Lion(model.parameters(), lr=1e-3), None))
    with caplog.at_level(logging.WARNING, logger="trainmem"):
        trainer.train()
    assert cb.report is None and "Lion" in cb.skipped
    assert "not checked" in caplog.text
    assert Reserve().fixed_bytes == 1 << 30  # the reserve the docs quote


def test_close_ends_the_cpu_meter_after_a_step_that_raised(tmp_path):
    import torch
    cb = TrainMemCallback(gpu="H100-80GB")
    bad = Tokens(vocab=5000)  # token ids past the model's 1000: the embedding raises inside the step
    trainer = Trainer(model=tiny_llama(), args=training_args(tmp_path), train_dataset=bad, callbacks=[cb])
    with pytest.raises(IndexError):
        trainer.train()
    assert torch._C._len_torch_dispatch_stack() == 1  # the meter, left by the Trainer
    cb.close()
    assert torch._C._len_torch_dispatch_stack() == 0
