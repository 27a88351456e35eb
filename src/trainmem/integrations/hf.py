"""trainmem inside the Hugging Face ``Trainer``: :class:`TrainMemCallback`.

At ``on_train_begin`` (transformers ``trainer.py`` ``Trainer._inner_training_loop``: after the
model is wrapped, the optimizer built and activation checkpointing enabled, before the first
batch) the callback reads the run off the live objects, estimates the per-device peak and
compares it with the device's usable memory. When it does not fit it logs advise's cheapest fix
and, with ``on_oom="stop"``, raises :class:`~trainmem.integrations.check.DoesNotFit`: setting
``control.should_training_stop`` would not do, because ``Trainer._run_epoch`` reads it only
after a step. Over the first ``measure_steps`` optimizer steps it measures the real peak and
logs it beside the prediction (the ``trainmem`` logger, at INFO like the Trainer's own run
summary, WARNING when it does not fit or disagrees; and a ``trainmem/*`` entry in
``state.log_history``, saved in ``trainer_state.json``).

What is read, and from where:
  - micro-batch ``state.train_batch_size`` (``per_device_train_batch_size``, lowered by
    ``auto_find_batch_size``), ``gradient_accumulation_steps``;
  - sequence length: ``seq=``, else the first training example's ``input_ids`` (noted);
  - precision: the parameters' dtype, under autocast when ``bf16``/``fp16`` is set;
  - recompute: the per-layer checkpointing flags on the model (or FSDP's ``activation_checkpointing``);
  - optimizer: the optimizer object the Trainer built (``optim`` = adamw_torch, adamw_torch_fused,
    adamw_bnb_8bit, paged_adamw_8bit, lion_8bit, rmsprop, adagrad, adafactor, sgd, ...; the ``optim``
    values whose memory trainmem does not model, galore_*, lomo, schedule_free_*..., are refused:
    ``integrations/read.py`` ``UNMODELLED_TRAINER_OPTIMS``);
  - attention: ``config._attn_implementation``; LoRA/QLoRA: the peft adapters;
  - parallel: ``world_size`` data-parallel ranks, DeepSpeed ZeRO stage and offload (the
    ``deepspeed`` config, read by ``trainmem.inputs.deepspeed``), FSDP (``fsdp_config``).

Known limitations:
  - ``torch_compile`` is not modelled (compiled graphs may save fewer activations): noted.
  - The check assumes every batch is ``seq`` tokens long.
"""

from __future__ import annotations

from transformers import TrainerCallback

from trainmem.errors import ConfigError, UnsupportedError
from trainmem.integrations import read as R
from trainmem.integrations.check import (DEFAULT_TOLERANCE, DoesNotFit, GuardReport, RunSpec, check_run,
                                         resolve_budget, validate_options)
from trainmem.integrations.meter import StepMeter
from trainmem.integrations.text import check_lines, log, log_check, log_measured
from trainmem.plan.hardware import Reserve
from trainmem.specs import ImplSpec, ParallelSpec, StepSpec

__all__ = ["TrainMemCallback", "largest_batch_args", "run_from_trainer", "parallel_from_trainer",
           "seq_from_dataset"]


def seq_from_dataset(dataset) -> int:
    """The length of the first example's ``input_ids`` (a map-style dataset)."""
    try:
        first = dataset[0]
        ids = first["input_ids"]
    except Exception:  # iterable datasets, other columns: the user must say
        raise ConfigError("seq: cannot read input_ids from the first training example; "
                          "pass TrainMemCallback(seq=...)") from None
    return len(ids)


def parallel_from_trainer(*, world_size: int, deepspeed=None, fsdp: bool = False,
                          fsdp_config: dict | None = None) -> tuple[ParallelSpec, dict, list[str]]:
    """(parallel spec, step overrides, notes) from the Trainer's distributed settings."""
    from trainmem.inputs.deepspeed import deepspeed_overrides, read_deepspeed

    notes: list[str] = []
    step: dict = {}
    fields: dict = {"dp": world_size}
    if deepspeed:
        ds = deepspeed_overrides(deepspeed) if isinstance(deepspeed, dict) else read_deepspeed(deepspeed)
        fields.update({k: v for k, v in ds["overrides"].get("parallel", {}).items() if k != "dp"})
        step = {k: v for k, v in ds["overrides"].get("step", {}).items() if k == "precision"}
        notes.extend(f"deepspeed: {n}" for n in ds["notes"])
    elif fsdp:
        cfg = fsdp_config or {}
        # FSDP2 takes a bool; FSDP1's strategies arrive as strings (training_args.py _process_fsdp_args)
        reshard = str(cfg.get("reshard_after_forward", True)).lower()
        if reshard.startswith("hybrid_shard"):
            raise UnsupportedError(f"fsdp {reshard}: the shard group size is not read; estimate it with "
                                   "`trainmem estimate --fsdp hybrid --fsdp-group N`")
        fields["fsdp"] = "full"
        fields["reshard_after_forward"] = reshard not in ("false", "shard_grad_op")
        # training_args.py _process_fsdp_args: fsdp_config["version"], default 2 (FSDP1 flat parameters)
        fields["fsdp_version"] = int(cfg.get("version", cfg.get("fsdp_version", 2)))
        if str(cfg.get("cpu_offload", False)).lower() == "true":
            fields["offload"] = ("params", "optimizer")
            notes.append("fsdp cpu_offload: parameters, gradients and optimizer states estimated on the host")
    return ParallelSpec(**fields), step, notes


def run_from_trainer(model, args, optimizer, *, seq: int | None = None, train_dataset=None,
                     batch: int | None = None) -> RunSpec:
    """The :class:`RunSpec` of a Trainer run: ``model`` (possibly peft-wrapped), its
    ``TrainingArguments`` and the optimizer the Trainer built (None: read from ``args.optim``).
    ``batch``: the per-device micro-batch when it is not ``per_device_train_batch_size``."""
    notes: list[str] = []
    if seq is None:
        seq = seq_from_dataset(train_dataset)
        notes.append(f"seq={seq} from the first training example's input_ids (pass seq= if batches are "
                     f"padded longer)")
    amp = "bf16" if args.bf16 else "fp16" if args.fp16 else None
    precision = R.precision_of(model, amp=amp)
    device = R.device_of(model)
    opt = (R.optimizer_of(optimizer, device=device) if optimizer is not None
           else R.trainer_optim_of(args.optim, args.optim_args, device=device, weight_decay=args.weight_decay))
    finetune = R.finetune_of(model)
    recompute, every = R.recompute_of(model).value
    fsdp_config = args.fsdp_config if isinstance(args.fsdp_config, dict) else None
    if args.fsdp and fsdp_config and str(fsdp_config.get("activation_checkpointing", False)).lower() == "true":
        recompute, every = "full", 1
        notes.append("recompute=full from fsdp_config activation_checkpointing")
    if (args.activation_checkpointing_kwargs or {}).get("offload"):
        notes.append("activation_checkpointing offload: checkpointed inputs on the host are not modelled")
    parallel, step_over, par_notes = parallel_from_trainer(
        world_size=args.world_size, deepspeed=args.deepspeed, fsdp=bool(args.fsdp), fsdp_config=fsdp_config)
    if args.deepspeed and "precision" not in step_over and amp:
        step_over["precision"] = f"mixed-{amp}"  # DeepSpeed's bf16/fp16: 16-bit weights, fp32 master
    if args.torch_compile:
        notes.append("torch_compile is not modelled: compiled graphs may save fewer activations")
    step = StepSpec(batch=batch or args.per_device_train_batch_size, seq=seq, grad_accum=args.gradient_accumulation_steps,
                    precision=step_over.get("precision", precision.value), optimizer=opt.value[0])
    impl = ImplSpec(attention=R.attention_of(model), recompute=recompute, recompute_every=every, device=device,
                    recompute_from="first", optimizer_impl=opt.value[1])  # flags on blocks 0, k, 2k (recompute_of)
    notes = [*notes, *precision.notes, *opt.notes, *finetune.notes, *par_notes]
    return RunSpec(model=R.model_spec_of(model), step=step, impl=impl, parallel=parallel,
                   finetune=finetune.value, notes=tuple(notes))


class TrainMemCallback(TrainerCallback):
    """Predict the peak before the first step, stop or warn when it will not fit, then measure.

    ``gpu``: a GPU preset (``"H100-80GB"``) and ``gpu_memory``: a size (``"24GiB"``) stand for the
    device on CPU (on CUDA its own capacity is used). ``on_oom``: ``"warn"`` or ``"stop"``.
    ``tolerance``: warn when measured ÷ predicted − 1 exceeds it. ``measure_steps``: optimizer
    steps measured. ``reserve``: the usable-memory reserve (plan and advise's default).

    After training, ``report`` holds a :class:`~trainmem.integrations.check.GuardReport`
    (``check`` before the first step, ``measured`` after the steps), or None when the run could
    not be read (the reason is logged and kept in ``skipped``).
    """

    def __init__(self, *, gpu: str | None = None, gpu_memory: str | int | None = None, seq: int | None = None,
                 on_oom: str = "warn", tolerance: float = DEFAULT_TOLERANCE, measure_steps: int = 2,
                 reserve: Reserve | None = None) -> None:
        validate_options(on_oom, tolerance, measure_steps, reserve)
        if seq is not None:
            StepSpec(seq=seq)  # names a bad seq now, not at the first step
        self.gpu, self.gpu_memory, self.seq, self.reserve = gpu, gpu_memory, seq, reserve
        # given sizes and presets are checked now; without them the CUDA device's capacity is read later
        self._budget = resolve_budget(gpu=gpu, gpu_memory=gpu_memory, reserve=reserve)
        self.on_oom, self.tolerance, self.measure_steps = on_oom, tolerance, measure_steps
        self.report: GuardReport | None = None
        self.skipped: str | None = None
        self._meter: StepMeter | None = None

    def on_train_begin(self, args, state, control, model=None, optimizer=None, train_dataloader=None, **kw):
        self.close()  # auto_find_batch_size runs the loop again after an OOM, with a smaller batch
        self.report, self.skipped = None, None
        # state.train_batch_size is the batch the loop really uses (auto_find_batch_size changes it):
        # per_device_train_batch_size × max(1, n_gpu) (transformers training_args.py train_batch_size)
        batch = state.train_batch_size // max(1, args.n_gpu) if state.train_batch_size else None
        try:
            run = run_from_trainer(model, args, optimizer, seq=self.seq, batch=batch,
                                   train_dataset=getattr(train_dataloader, "dataset", None))
        except UnsupportedError as exc:
            self.skipped = str(exc)
            log.warning("trainmem: this run is not checked: %s", exc)
            return
        budget = self._budget or resolve_budget(device=args.device, reserve=self.reserve)
        check = check_run(run, budget)
        self.report = GuardReport(check, tolerance=self.tolerance)
        log_check(check)
        state.log_history.append({"trainmem/predicted_peak_bytes": check.predicted_peak_bytes,
                                  "trainmem/predicted_reserved_bytes": check.predicted_reserved_bytes,
                                  "trainmem/usable_bytes": check.budget.usable_bytes if check.budget else None,
                                  "trainmem/fit_state": check.fit_state,
                                  "step": state.global_step})
        if check.runs is False and self.on_oom == "stop":  # a step that runs by flushing the cache is warned of
            raise DoesNotFit("\n".join(check_lines(check)), check)
        self._meter = StepMeter(model, optimizer, args.device)

    def on_step_begin(self, args, state, control, **kw):
        if self._meter is not None and len(self._meter.peaks) < self.measure_steps:
            self._meter.begin_step()

    def on_step_end(self, args, state, control, **kw):
        if self._meter is None or not self._meter.active:
            return
        self._meter.end_step()
        if len(self._meter.peaks) == self.measure_steps:
            self._finish(state)

    def on_train_end(self, args, state, control, **kw):
        if self._meter is not None:
            self._finish(state)

    def close(self) -> None:
        """Stop measuring now. ``on_train_end`` does it; call this after a step that raised (the
        Trainer then calls no callback), so the CPU meter's dispatch mode ends."""
        if self._meter is not None:
            self._meter.close()
            self._meter = None

    def _finish(self, state) -> None:
        measured = self._meter.close()
        self._meter = None
        if measured is None:
            return
        self.report = GuardReport(self.report.check, measured, self.tolerance)
        log_measured(self.report)
        state.log_history.append({"trainmem/predicted_peak_bytes": self.report.check.predicted_peak_bytes,
                                  "trainmem/measured_peak_bytes": measured.peak_bytes,
                                  "trainmem/measured_reserved_bytes": measured.peak_reserved_bytes,
                                  "trainmem/ratio": self.report.ratio, "step": state.global_step})


def largest_batch_args(args, model, *, seq: int | None = None, train_dataset=None, gpu: str | None = None,
                       gpu_memory: str | int | None = None, reserve: Reserve | None = None,
                       backend: str = "estimate", max_batch: int = 1 << 16):
    """``(TrainingArguments, BatchFit)``: a copy of ``args`` whose ``per_device_train_batch_size``
    is the largest micro-batch predicted to fit (:func:`trainmem.largest_micro_batch`), the run
    read as :class:`TrainMemCallback` reads it (the optimizer from ``args.optim``). The gradient
    accumulation is left as it is. Call it before building the ``Trainer``."""
    import copy

    from trainmem.integrations.batch import largest_micro_batch

    run = run_from_trainer(model, args, None, seq=seq, train_dataset=train_dataset)
    fit = largest_micro_batch(model, step=run.step, impl=run.impl, finetune=run.finetune,
                              parallel=run.parallel, gpu=gpu, gpu_memory=gpu_memory, reserve=reserve,
                              backend=backend, max_batch=max_batch)
    if fit.batch is None:
        flush = (f"; micro-batches up to {fit.batch_with_flush} run only by flushing the allocator cache (slower)"
                 if fit.batch_with_flush else "")
        raise ConfigError(f"per_device_train_batch_size: not even 1 fits in {fit.budget.usable_bytes} usable "
                          f"bytes ({fit.budget.source}){flush}; see `trainmem advise`")
    new = copy.deepcopy(args)
    new.per_device_train_batch_size = fit.batch
    return new, fit
