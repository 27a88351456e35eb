"""``trainmem advise``: walk the brief's ladder for a configuration that does not fit.

The ladder, in order (brief §8): efficient attention; smaller micro-batch with gradient
accumulation; selective, then full activation checkpointing; sequence/tensor parallelism (then
ZeRO sharding of the model states, when more than one GPU is given); shorter or bucketed sequences;
CPU offload of the optimizer. Each rung is applied on top of the previous ones and measured with
the estimator (:func:`~trainmem.plan.ranks.per_rank_peak`); a rung that does not apply (already
on, nothing to shrink, no GPUs to spread over) or saves nothing is listed with the reason and not
recommended. The walk stops as soon as the peak fits.

``throughput_cost`` is the share of tokens/s lost by the rung, from :func:`trainmem.plan.cost.step_time`
at the same global batch: ``1 − tokens/s after ÷ tokens/s before``, positive when the step gets slower,
negative when it gets faster (:data:`THROUGHPUT_COST`; the JSON states it under ``conventions``).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from trainmem.estimate.notes import selective_recompute_noop
from trainmem.plan.cost import CostModel, matmul_parameters, step_time
from trainmem.plan.hardware import GPU, Reserve
from trainmem.plan.ranks import per_rank_peak
from trainmem.specs import ImplSpec, ModelSpec, ParallelSpec, StepSpec

__all__ = ["AdviceStep", "Advice", "advise", "SCHEMA", "RUNGS", "THROUGHPUT_COST"]

SCHEMA = "trainmem.advise/1"
THROUGHPUT_COST = ("1 - tokens_per_s_after / tokens_per_s_before: positive is slower (the share of tokens/s lost), "
                   "negative is faster")
RUNGS = ("attention", "micro_batch", "selective_recompute", "full_recompute", "tensor_parallel",
         "zero", "shorter_sequences", "offload")
_MIN_SEQ = 256  # below this, "shorter sequences" stops being a training choice


@dataclass(frozen=True)
class AdviceStep:
    rung: str
    action: str
    saved_bytes: int
    peak_bytes_after: int
    throughput_cost: float
    config: dict
    note: str = ""

    def to_dict(self) -> dict:
        return {"rung": self.rung, "action": self.action, "saved_bytes": self.saved_bytes,
                "peak_bytes_after": self.peak_bytes_after, "throughput_cost": self.throughput_cost,
                "config": self.config, "note": self.note}


@dataclass(frozen=True)
class Advice:
    model: ModelSpec
    step: StepSpec
    impl: ImplSpec
    gpu: GPU
    gpus: int
    usable_bytes: int
    start_peak_bytes: int
    steps: tuple[AdviceStep, ...]
    skipped: tuple[tuple[str, str], ...]
    fits: bool
    reserve: Reserve = field(default_factory=Reserve)

    def to_dict(self) -> dict:
        return {"schema": SCHEMA, "model": self.model.name, "gpu": self.gpu.name, "gpus": self.gpus,
                "usable_bytes": self.usable_bytes, "reserve": self.reserve.to_dict(),
                "start_peak_bytes": self.start_peak_bytes,
                "steps": [s.to_dict() for s in self.steps],
                "skipped": [{"rung": r, "why": w} for r, w in self.skipped], "fits": self.fits,
                "conventions": {"throughput_cost": THROUGHPUT_COST}}


@dataclass(frozen=True)
class _State:
    step: StepSpec
    impl: ImplSpec
    par: ParallelSpec

    def config(self) -> dict:
        p = self.par
        return {"micro_batch": self.step.batch, "grad_accum": self.step.grad_accum, "seq": self.step.seq,
                "attention": self.impl.attention, "recompute": self.impl.recompute, "dp": p.dp, "tp": p.tp,
                "sp": p.sp, "zero": p.zero, "offload": list(p.offload)}


def advise(model: ModelSpec, step: StepSpec, impl: ImplSpec, gpu: GPU, *, gpus: int = 1,
           reserve: Reserve = Reserve(), cost: CostModel = CostModel()) -> Advice:
    """The ladder for ``model`` trained with ``step``/``impl`` on ``gpus`` × ``gpu`` (data parallel
    to start with)."""
    usable = reserve.usable_bytes(gpu)
    n_params = matmul_parameters(model)
    state = _State(step, impl, ParallelSpec(dp=gpus))
    global_batch = step.batch * step.grad_accum * gpus

    def peak(s: _State) -> int:
        return per_rank_peak(model, s.step, s.impl, s.par)

    def tokens_per_s(s: _State) -> float:
        t = step_time(model, s.step, s.impl, s.par, gpu, global_batch=global_batch, cost=cost, n_params=n_params)
        return global_batch * step.seq / t.total_s  # tokens of the original step, whatever the sequence

    now = peak(state)
    start = now
    steps: list[AdviceStep] = []
    skipped: list[tuple[str, str]] = []
    for rung in RUNGS:
        if now <= usable:
            break
        proposal = _propose(rung, state, model, gpu, gpus, lambda s: peak(s) <= usable)
        if isinstance(proposal, str):
            skipped.append((rung, proposal))
            continue
        new, action, note = proposal
        after = peak(new)
        if after >= now:
            skipped.append((rung, f"{action} saves nothing here: the peak is set by memory this rung does not change"))
            continue
        cost_frac = 1 - tokens_per_s(new) / tokens_per_s(state)
        steps.append(AdviceStep(rung, action, now - after, after, cost_frac, new.config(), note))
        state, now = new, after
    return Advice(model, step, impl, gpu, gpus, usable, start, tuple(steps), tuple(skipped), now <= usable, reserve)


def _propose(rung: str, s: _State, model: ModelSpec, gpu: GPU, gpus: int, fits) -> tuple[_State, str, str] | str:
    """The rung applied to ``s``, or why it does not apply."""
    step, impl, par = s.step, s.impl, s.par
    if rung == "attention":
        if impl.attention not in ("eager", "sdpa-math"):
            return f"attention is already {impl.attention} (no S×S matrix is saved)"
        fused = "flash" if impl.device == "cuda" and step.dtypes.activation in ("bfloat16", "float16") else "mem-efficient"
        return (replace(s, impl=replace(impl, attention=fused)), f"attention {impl.attention} → {fused}",
                "exact attention; the B·A·S² score and probability tensors are no longer saved")
    if rung == "micro_batch":
        if step.batch == 1:
            return "micro-batch is already 1"
        options = [d for d in range(step.batch - 1, 0, -1) if step.batch % d == 0]
        trial = [replace(s, step=replace(step, batch=d, grad_accum=step.grad_accum * (step.batch // d))) for d in options]
        new = next((t for t in trial if fits(t)), trial[-1])
        b = new.step.batch
        return (new, f"micro-batch {step.batch} → {b} with gradient accumulation {step.grad_accum} → "
                     f"{new.step.grad_accum} (same {step.batch * step.grad_accum} sequences per step)",
                "activations scale with the micro-batch; the accumulated gradients stay")
    if rung == "selective_recompute":
        if impl.recompute != "none":
            return f"recompute is already {impl.recompute}"
        noop = selective_recompute_noop(model, step, impl)
        if noop:
            return noop
        return (replace(s, impl=replace(impl, recompute="selective", recompute_every=1)),
                "selective activation checkpointing (recompute the attention core in backward)", "")
    if rung == "full_recompute":
        if impl.recompute == "full":
            return "recompute is already full"
        return (replace(s, impl=replace(impl, recompute="full", recompute_every=1)),
                "full activation checkpointing (keep block inputs, recompute each block in backward)",
                "about one extra forward per step")
    if rung == "tensor_parallel":
        if gpus == 1:
            return "one GPU: sequence/tensor parallelism needs --gpus > 1"
        if par.tp > 1:
            return f"tensor parallelism is already {par.tp}"
        degrees = [t for t in (2, 4, 8, 16) if t <= min(gpus, gpu.gpus_per_node) and gpus % t == 0
                   and model.num_heads % t == 0 and model.ffn_size % t == 0 and step.seq % t == 0]
        if not degrees:
            return f"no TP degree ≤ {gpu.gpus_per_node} divides {gpus} GPUs, {model.num_heads} heads and the FFN"
        trial = [replace(s, par=replace(par, tp=t, sp=True, dp=par.dp // t),
                         step=replace(step, grad_accum=step.grad_accum * t)) for t in degrees]
        new = next((t for t in trial if fits(t)), trial[-1])
        t = new.par.tp
        return (new, f"tensor parallelism {t} with sequence parallelism (data parallel {par.dp} → {new.par.dp}, "
                     f"gradient accumulation {step.grad_accum} → {new.step.grad_accum}: same global batch)",
                "heads and the FFN split over the TP group; SP splits norms and residuals over tokens")
    if rung == "zero":
        if par.dp == 1:
            return "one data-parallel rank: nothing to shard the model states over"
        if par.zero == 3:
            return "ZeRO-3 already shards every model state"
        trial = [replace(s, par=replace(par, zero=z)) for z in (1, 2, 3) if z > par.zero]
        new = next((t for t in trial if fits(t)), trial[-1])
        return (new, f"ZeRO stage {new.par.zero} over {par.dp} data-parallel ranks",
                "shards model states only (beyond the brief's ladder); activations are unchanged")
    if rung == "shorter_sequences":
        if step.seq <= _MIN_SEQ:
            return f"sequence is already {step.seq} tokens"
        trial = []
        seq, accum = step.seq, step.grad_accum
        while seq // 2 >= _MIN_SEQ and seq % 2 == 0 and len(trial) < 2:  # at most a quarter
            seq, accum = seq // 2, accum * 2
            trial.append(replace(s, step=replace(step, seq=seq, grad_accum=accum)))
        if not trial:
            return f"sequence {step.seq} cannot be halved to {_MIN_SEQ} tokens or more"
        new = next((t for t in trial if fits(t)), trial[-1])
        return (new, f"shorter or bucketed sequences: {step.seq} → {new.step.seq} tokens, gradient accumulation "
                     f"{step.grad_accum} → {new.step.grad_accum} (same tokens per step)",
                "changes the data: long documents are split or bucketed; check convergence")
    if rung == "offload":
        if "optimizer" in par.offload:
            return "optimizer states are already offloaded"
        if step.optimizer == "sgd" and not step.dtypes.master:
            return "plain SGD keeps no optimizer state to offload"
        return (replace(s, par=replace(par, offload=("optimizer",), zero=max(par.zero, 1))),
                "offload optimizer states (and master weights) to CPU memory (ZeRO-Offload)",
                "optimizer step on the CPU; gradients and parameters cross PCIe every step")
    raise AssertionError(rung)
