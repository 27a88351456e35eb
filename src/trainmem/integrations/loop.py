"""``trainmem.guard``: check-then-measure for a plain PyTorch training loop.

>>> report = trainmem.guard(model, optimizer, step, batch=8, seq=512, gpu="A100-40GB", on_oom="stop")
>>> report.check.fits, report.measured.peak_bytes, report.ratio

The model is read as the Trainer callback reads it (``integrations.read``): a transformers model
(peft-wrapped or not) maps onto a ModelSpec through its config; any other module needs
``spec=``. Autocast inside ``step_fn`` cannot be seen from outside: pass ``precision=``
(``"amp-bf16"``) when the step runs under ``torch.autocast``.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Callable

from trainmem.integrations import read as R
from trainmem.integrations.check import (DEFAULT_TOLERANCE, DoesNotFit, GuardReport, RunSpec, check_run,
                                         resolve_budget, validate_options)
from trainmem.integrations.meter import StepMeter
from trainmem.integrations.text import check_lines, log_check, log_measured
from trainmem.plan.hardware import Reserve
from trainmem.specs import ImplSpec, ModelSpec, ParallelSpec, StepSpec
from trainmem.specs.finetune import FinetuneSpec

__all__ = ["guard", "run_from_module"]


def run_from_module(model, optimizer, *, batch: int, seq: int, grad_accum: int = 1, precision: str | None = None,
                    spec: ModelSpec | None = None, impl: ImplSpec | None = None,
                    finetune: FinetuneSpec | None = None, parallel: ParallelSpec | None = None) -> RunSpec:
    """The :class:`RunSpec` of a plain loop: what is given, the rest read off the model and optimizer."""
    notes: list[str] = []
    hf = spec is None
    if hf:
        spec = R.model_spec_of(model)
    device = R.device_of(model)
    if precision is None:
        read = R.precision_of(model, amp=None)
        precision = read.value
        notes.extend(read.notes)
        if precision == "fp32":
            notes.append("precision=fp32 from the parameters; autocast inside step_fn is not visible "
                         "(pass precision='amp-bf16')")
    opt = R.optimizer_of(optimizer, device=device)
    notes.extend(opt.notes)
    if finetune is None:
        ft = R.finetune_of(model)
        finetune = ft.value
        notes.extend(ft.notes)
    if impl is None:
        if hf:
            recompute, every = R.recompute_of(model).value
            impl = ImplSpec(attention=R.attention_of(model), recompute=recompute, recompute_every=every, device=device,
                            recompute_from="first", optimizer_impl=opt.value[1])  # blocks 0, k, 2k (recompute_of)
        else:
            impl = ImplSpec(device=device, optimizer_impl=opt.value[1])
            notes.append("impl not read from a module without a Hugging Face config: ImplSpec defaults "
                         f"(attention={impl.attention}, recompute={impl.recompute}); pass impl=")
    elif impl.optimizer_impl == "auto":  # the live optimizer says which
        impl = replace(impl, optimizer_impl=opt.value[1])
    step = StepSpec(batch=batch, seq=seq, grad_accum=grad_accum, precision=precision, optimizer=opt.value[0])
    return RunSpec(model=spec, step=step, impl=impl, parallel=parallel or ParallelSpec(), finetune=finetune,
                   notes=tuple(notes))


def guard(model, optimizer, step_fn: Callable[[], Any], *, batch: int, seq: int, grad_accum: int = 1,
          precision: str | None = None, spec: ModelSpec | None = None, impl: ImplSpec | None = None,
          finetune: FinetuneSpec | None = None, parallel: ParallelSpec | None = None,
          gpu: str | None = None, gpu_memory: str | int | None = None, reserve: Reserve | None = None,
          steps: int = 2, on_oom: str = "warn", tolerance: float = DEFAULT_TOLERANCE) -> GuardReport:
    """Estimate the step, compare it with the device (``gpu``/``gpu_memory`` on CPU, the CUDA
    device's capacity otherwise), then run ``step_fn`` ``steps`` times (real training steps: one
    optimizer step each) measuring each step's peak. With ``on_oom="stop"`` a step that will not
    fit raises :class:`~trainmem.integrations.check.DoesNotFit` before ``step_fn`` runs, with
    advise's cheapest fix in the message."""
    validate_options(on_oom, tolerance, steps, reserve, steps_field="steps")
    run = run_from_module(model, optimizer, batch=batch, seq=seq, grad_accum=grad_accum, precision=precision,
                          spec=spec, impl=impl, finetune=finetune, parallel=parallel)
    dev = next(iter(model.parameters())).device
    check = check_run(run, resolve_budget(gpu=gpu, gpu_memory=gpu_memory, device=dev, reserve=reserve))
    log_check(check)
    if check.runs is False and on_oom == "stop":  # a step that runs by flushing the cache is warned of
        raise DoesNotFit("\n".join(check_lines(check)), check)
    meter = StepMeter(model, optimizer, dev)
    try:
        for _ in range(steps):
            meter.begin_step()
            step_fn()
            meter.end_step()
    finally:
        measured = meter.close()
    report = GuardReport(check, measured, tolerance)
    log_measured(report)
    return report
