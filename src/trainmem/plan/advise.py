"""``trainmem advise``: the cheapest sets of changes that fit, and the brief's ladder as the explanation.

**The search** (:func:`search`): every combination of up to ``max_changes`` choices of
:mod:`trainmem.plan.choices` (attention kernel, micro-batch with accumulation, recompute, loss
kernel, optimizer kernel and placement, 8-bit optimizer, ZeRO/FSDP, TP+SP, optimizer and
activation offload, LoRA/QLoRA), each applied to the user's configuration. Every combination is
first priced with :func:`trainmem.plan.cost.step_time` (microseconds), then measured with the
estimator (:func:`~trainmem.plan.ranks.per_rank_peak`, memoized per configuration) in order of
that price, cheapest first. A combination that contains a fitting one is skipped (not minimal).
The search stops when ``top`` configurations fit and no unmeasured one can be cheaper, or after
``budget`` estimates; it reports how many it measured. Activation offload's PCIe traffic needs
the activation bytes: it is ordered with the start's activations and priced once measured.

**The ladder**, in order (brief §8): efficient attention; smaller micro-batch with gradient
accumulation; selective, then full activation checkpointing; sequence/tensor parallelism (then
ZeRO sharding of the model states, when more than one GPU is given); shorter or bucketed sequences;
CPU offload of the optimizer. Each rung is applied on top of the previous ones and measured; a rung
that does not apply (already on, nothing to shrink, no GPUs to spread over) or saves nothing is
listed with the reason and not recommended. The walk stops as soon as the peak fits.

**Fits** means what ``estimate --memory-figure reserved`` says: the configuration's reserved peak
(its estimate replayed through the caching-allocator model,
:func:`trainmem.estimate.allocation_order.estimate_reserved`) is within capacity − context − NCCL
buffers (more than one rank) − ``--reserve-fraction`` × capacity (an extra margin, 0 by default;
:meth:`~trainmem.plan.hardware.Reserve.reserved_usable_bytes`). Every peak is stated twice:
``peak_bytes`` allocated (the estimate's), ``peak_reserved_bytes`` reserved (the verdict's);
headroom is usable − reserved.

``throughput_cost`` is the share of tokens/s lost, from :func:`trainmem.plan.cost.step_time` at the
same global batch: ``1 − tokens/s after ÷ tokens/s before``, positive when the step gets slower,
negative when it gets faster (:data:`THROUGHPUT_COST`; the JSON states it under ``conventions``).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from itertools import combinations
from typing import Any

from trainmem.errors import TrainmemError
from trainmem.estimate import estimate
from trainmem.estimate.notes import selective_recompute_noop
from trainmem.families import family_attentions
from trainmem.plan.choices import CHOICES, Config, Context, fused_attention, tp_degrees
from trainmem.plan.cost import CostModel, matmul_parameters, step_time
from trainmem.plan.hardware import GPU, Reserve
from trainmem.specs import ImplSpec, ModelSpec, ParallelSpec, StepSpec

__all__ = ["AdviceStep", "Advice", "Option", "SearchStats", "advise", "search", "SCHEMA", "RUNGS",
           "THROUGHPUT_COST", "DEFAULT_BUDGET", "DEFAULT_MAX_CHANGES"]

SCHEMA = "trainmem.advise/2"
THROUGHPUT_COST = ("1 - tokens_per_s_after / tokens_per_s_before: positive is slower (the share of tokens/s lost), "
                   "negative is faster")
RUNGS = ("attention", "micro_batch", "selective_recompute", "full_recompute", "tensor_parallel",
         "zero", "shorter_sequences", "offload")
DEFAULT_BUDGET = 64  # estimates; a per-rank estimate of an 8B model takes ~0.15 s on an idle core
DEFAULT_MAX_CHANGES = 3
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
    reserved_bytes_after: int = 0
    """The reserved peak after the step (allocator model): what the fit compares."""

    def to_dict(self) -> dict:
        return {"rung": self.rung, "action": self.action, "saved_bytes": self.saved_bytes,
                "peak_bytes_after": self.peak_bytes_after, "throughput_cost": self.throughput_cost,
                "config": self.config, "note": self.note, "peak_reserved_bytes_after": self.reserved_bytes_after}


@dataclass(frozen=True)
class Option:
    """One fitting set of changes found by the search."""

    changes: tuple[str, ...]
    """Choice names (:data:`trainmem.plan.choices.CHOICES`), in the order applied."""
    actions: tuple[str, ...]
    peak_bytes: int
    headroom_bytes: int
    throughput_cost: float
    changes_training: bool
    """Some change makes it a different training run (adapters on a frozen base)."""
    config: dict
    command: str
    """The ``trainmem estimate`` line whose peak is ``peak_bytes``."""
    reserved_bytes: int = 0
    """The reserved peak (allocator model; ``estimate --memory-figure reserved``): ``headroom_bytes``
    is usable less this."""

    def to_dict(self) -> dict:
        return {"changes": list(self.changes), "actions": list(self.actions), "peak_bytes": self.peak_bytes,
                "peak_reserved_bytes": self.reserved_bytes,
                "headroom_bytes": self.headroom_bytes, "throughput_cost": self.throughput_cost,
                "changes_training": self.changes_training, "config": self.config, "command": self.command}


@dataclass(frozen=True)
class SearchStats:
    candidates: int
    """Combinations priced."""
    evaluated: int
    """Estimates run (memoized per configuration)."""
    budget: int
    max_changes: int
    complete: bool
    """No unmeasured combination could be cheaper than the options returned."""
    tried: dict[str, int]
    """Per choice: measured combinations that contain it."""
    choices: tuple[str, ...]
    """The registered choices (those whose spec fields exist)."""
    why: str = ""
    """Why nothing was measured, when nothing can fit."""

    def to_dict(self) -> dict:
        return {"candidates": self.candidates, "evaluated": self.evaluated, "budget": self.budget,
                "max_changes": self.max_changes, "complete": self.complete, "tried": dict(self.tried),
                "choices": list(self.choices), "why": self.why}


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
    options: tuple[Option, ...] = ()
    stats: SearchStats | None = None
    start_command: str = ""
    parallel: ParallelSpec | None = None  # the starting layout, echoed in the header's inputs
    finetune: Any = None
    start_reserved_bytes: int = 0
    """The start's reserved peak (allocator model), compared with ``usable_bytes``."""
    fit_state: str = ""
    """The starting configuration's :data:`trainmem.fits.FIT_STATES`; ``fits_with_cache_flush``: it
    runs only by flushing the allocator cache, and the options and the ladder make it fit without."""
    flush: Any = None
    """The start's :class:`~trainmem.estimate.allocation_order.FlushReplay`, where one ran."""

    def to_dict(self) -> dict:
        from trainmem.schemas import header
        out = header("advise", model=self.model, step=self.step, impl=self.impl, parallel=self.parallel,
                     finetune=self.finetune, gpu=self.gpu)
        out["inputs"]["gpus"] = self.gpus
        return {**out, "usable_bytes": self.usable_bytes, "reserve": self.reserve.to_dict(),
                "memory_figure": {"figure": "reserved", "peak_reserved_bytes": self.start_reserved_bytes},
                "start_peak_bytes": self.start_peak_bytes, "start_command": self.start_command,
                "fit_state": self.fit_state,
                "options": [o.to_dict() for o in self.options],
                "search": None if self.stats is None else self.stats.to_dict(),
                "steps": [s.to_dict() for s in self.steps],
                "skipped": [{"rung": r, "why": w} for r, w in self.skipped], "fits": self.fits,
                "conventions": {"throughput_cost": THROUGHPUT_COST}}


class _Measure:
    """Per-rank peaks (allocated, reserved) and activation bytes, one estimate per configuration:
    ``(allocated, activation, reserved)``, reserved from the allocator model (the fit's figure).

    The replay costs about as much as the estimate, so it runs only where it can change the verdict:
    when the allocated peak is over ``usable`` the reserved one is too (the replay's reserve is never
    negative), and the third element is then the allocated peak, a bound that already fails;
    :meth:`reserved` replays such a configuration when its exact figure is printed."""

    def __init__(self, model: ModelSpec, usable: int | None = None) -> None:
        self.model, self.memo, self.failed, self.usable = model, {}, {}, usable
        self.host: dict[Config, int] = {}  # what activation offload sends to host (one device)
        self.unreplayed: dict[Config, Any] = {}  # estimates whose reserved peak was bounded, not replayed

    def reserved(self, c: Config) -> int:
        """The exact reserved peak of a measured configuration."""
        from trainmem.estimate.allocation_order import estimate_reserved
        e = self.unreplayed.pop(c, None)
        if e is not None:
            got = self.memo[c]
            self.memo[c] = (got[0], got[1], estimate_reserved(e).reserved_bytes)
        return self.memo[c][2]

    def __call__(self, c: Config) -> tuple[int, int, int] | None:
        if c not in self.memo and c not in self.failed:
            par = None if c.par.is_single else c.par
            try:
                e = estimate(self.model, c.step, c.impl, par, finetune=c.finetune)
            except TrainmemError as exc:  # a combination the estimator refuses (e.g. in-backward + ZeRO)
                self.failed[c] = str(exc)
                return None
            from trainmem.estimate.allocation_order import estimate_reserved
            if self.usable is not None and e.peak_bytes > self.usable:  # reserved >= allocated > usable
                self.memo[c] = (e.peak_bytes, e.totals_bytes.get("activation", 0), e.peak_bytes)
                self.unreplayed[c] = e
            else:
                self.memo[c] = (e.peak_bytes, e.totals_bytes.get("activation", 0), estimate_reserved(e).reserved_bytes)
            if e.host is not None:
                self.host[c] = e.host.total()
        return self.memo.get(c)

    @property
    def runs(self) -> int:
        return len(self.memo) + len(self.failed)


class _Clock:
    """Tokens/s of a configuration relative to the start, at the start's global batch."""

    def __init__(self, model: ModelSpec, start: Config, gpu: GPU, cost: CostModel) -> None:
        self.model, self.gpu, self.cost = model, gpu, cost
        self.global_batch = start.step.batch * start.step.grad_accum * start.par.dp
        self.n_params = matmul_parameters(model)
        self.start_s = self.seconds(start)

    def seconds(self, c: Config, offloaded_activation_bytes: int = 0) -> float:
        return step_time(self.model, c.step, c.impl, c.par, self.gpu, global_batch=self.global_batch,
                         cost=self.cost, n_params=self.n_params, finetune=c.finetune,
                         offloaded_activation_bytes=offloaded_activation_bytes).total_s

    def throughput_cost(self, c: Config, offloaded_activation_bytes: int = 0) -> float:
        # the original step's tokens per second, whatever the sequence: 1 - t_before / t_after
        return 1 - self.start_s / self.seconds(c, offloaded_activation_bytes)


def _combinations(start: Config, ctx: Context, max_changes: int):
    """(choice names, actions, config) for every set of up to ``max_changes`` choices, applied in
    registry order; each configuration once (the fewest changes that reach it)."""
    names = list(CHOICES)
    seen: set[Config] = {start}
    for k in range(1, max_changes + 1):
        for subset in combinations(names, k):
            stack = [((), (), start)]
            for name in subset:
                stack = [(n + (name,), a + (act,), new) for n, a, c in stack
                         for new, act in CHOICES[name].variants(c, ctx)]
            for n, a, c in stack:
                if c not in seen:
                    seen.add(c)
                    yield n, a, c


def search(model: ModelSpec, start: Config, gpu: GPU, usable_bytes: int, *, gpus: int,
           cost: CostModel = CostModel(), top: int = 5, top_changing: int = 2, budget: int = DEFAULT_BUDGET,
           max_changes: int = DEFAULT_MAX_CHANGES, model_name: str | None = None,
           measure: _Measure | None = None) -> tuple[tuple[Option, ...], SearchStats]:
    """The ``top`` cheapest fitting configurations (by step time) reachable from ``start`` by up to
    ``max_changes`` choices that keep the training, then the ``top_changing`` cheapest that change
    it (LoRA/QLoRA), searched in that order; a quarter of ``budget`` is kept for the second group."""
    measure = measure or _Measure(model, usable_bytes)
    ctx = Context(model, gpus, gpu.gpus_per_node, fp8=gpu.fp8_flops is not None)
    combos = list(_combinations(start, ctx, max_changes))
    # no choice stores a weight in fewer than 4 bits or shards it over more than every GPU: past that
    # floor only a configuration whose parameters live in host memory (--offload params: the start's,
    # or FSDP CPU offload, choices.fsdp_cpu_offload) can fit, and only those are measured
    floor = matmul_parameters(model)[1] // 2 // gpus
    if floor > usable_bytes:
        combos = [t for t in combos if "params" in t[2].par.offload]
        if not combos and "params" not in start.par.offload:
            from trainmem.report.units import fmt_bytes
            why = (f"even 4-bit weights sharded over {gpus} GPU{'s' if gpus > 1 else ''} take {fmt_bytes(floor)} "
                   f"per GPU, more than the usable {fmt_bytes(usable_bytes)}, and no set of up to {max_changes} "
                   f"changes keeps the parameters in host memory (FSDP CPU offload needs FSDP over more than one GPU)")
            return (), SearchStats(0, measure.runs, budget, max_changes, True, {}, tuple(CHOICES), why)
    clock = _Clock(model, start, gpu, cost)
    start_activation_bytes = (measure(start) or (0, 0, 0))[1]

    def price(c: Config) -> float:
        # activation offload is priced with the start's activations (per sequence) until measured
        moved = start_activation_bytes * c.step.batch // start.step.batch if "activations" in c.par.offload else 0
        return clock.throughput_cost(c, moved)

    priced = sorted(((any(CHOICES[x].changes_training for x in n), price(c), len(n), n, a, c)
                     for n, a, c in combos), key=lambda t: t[:3])
    found: dict[bool, list[Option]] = {False: [], True: []}
    wanted = {False: top, True: top_changing}
    fitting: list[frozenset[tuple[str, str]]] = []
    tried: dict[str, int] = {}
    complete = True
    reserve = budget // 4 if any(t[0] for t in priced) else 0  # kept for the group that changes the training
    for group, limit in ((False, budget - reserve), (True, budget)):
        for changing, price_first, _, names, actions, c in priced:
            if changing != group:
                continue
            kept = sorted(o.throughput_cost for o in found[changing])[:wanted[changing]]
            if len(kept) >= wanted[changing] and (not kept or kept[-1] <= price_first):
                break  # nothing left in this group can be cheaper than what is kept
            made = set(zip(names, actions))
            if any(f <= made for f in fitting):
                continue  # contains a fitting set of changes: not minimal
            if any(set(o.changes) == set(names) and o.throughput_cost <= price_first for o in found[changing]):
                continue  # these choices fit already in another variant, at no more cost: shown once
            plain = replace(c, par=replace(c.par, offload=tuple(o for o in c.par.offload if o != "activations")))
            if measure.runs + 1 + (plain != c) > limit:
                complete = False
                break
            got = measure(c)
            for n in names:
                tried[n] = tried.get(n, 0) + 1
            if got is None or got[2] > usable_bytes:  # the reserved peak against the reserved budget
                continue
            # activation offload moves what the same configuration would keep: priced once measured
            # (the estimate's host figure where it models the offload: estimate/activation_offload.py)
            offloaded = measure.host.get(c) or (measure(plain)[1] if plain != c and measure(plain) else 0)
            fitting.append(frozenset(made))
            if any(set(o.changes) == set(names) for o in found[changing]):
                continue  # another variant of the same choices fits already
            found[changing].append(Option(names, actions, got[0], usable_bytes - got[2],
                                          clock.throughput_cost(c, offloaded), changing, c.config(),
                                          c.command(model_name or model.name), reserved_bytes=got[2]))
    options = tuple(o for changing in (False, True) for o in
                    _undominated(sorted(found[changing], key=lambda o: (o.throughput_cost, len(o.changes))))
                    [:wanted[changing]])
    stats = SearchStats(len(priced), measure.runs, budget, max_changes, complete, tried, tuple(CHOICES))
    return options, stats


def _undominated(options: list[Option]) -> list[Option]:
    """Drop an option another one beats or equals on cost, peak and number of changes."""
    def beats(a: Option, b: Option) -> bool:
        return (a is not b and a.throughput_cost <= b.throughput_cost and a.peak_bytes <= b.peak_bytes
                and len(a.changes) <= len(b.changes))
    return [o for i, o in enumerate(options)
            if not any(beats(p, o) and (options.index(p) < i or not beats(o, p)) for p in options)]


def advise(model: ModelSpec, step: StepSpec, impl: ImplSpec, gpu: GPU, *, gpus: int | None = None,
           parallel: ParallelSpec | None = None, finetune=None, reserve: Reserve | None = None,
           cost: CostModel = CostModel(), top: int = 5, budget: int = DEFAULT_BUDGET,
           max_changes: int = DEFAULT_MAX_CHANGES, model_name: str | None = None) -> Advice:
    """The cheapest changes that make ``model`` trained with ``step``/``impl`` (on ``parallel``, or
    data parallel over ``gpus`` × ``gpu``; ``finetune``: a FinetuneSpec) fit, and the ladder."""
    from trainmem.errors import SpecError

    par = parallel or ParallelSpec(dp=gpus or 1)
    if gpus is not None and gpus != par.world_size:
        raise SpecError("gpus", gpus, f"differs from the parallel layout's {par.world_size} ranks "
                                      f"(dp {par.dp} × tp {par.tp} × cp {par.cp} × pp {par.pp})")
    gpus = par.world_size
    reserve = Reserve.modelled(gpu) if reserve is None else reserve
    usable = reserve.reserved_usable_bytes(gpu, gpus)
    start = Config(step, impl, par, finetune)
    measure = _Measure(model, usable)
    clock = _Clock(model, start, gpu, cost)
    first = measure(start)
    if first is None:
        raise SpecError("configuration", start.command(model_name or model.name), measure.failed[start])
    now, held = begin, begin_reserved = first[0], measure.reserved(start)
    start_state, start_flush = _start_state(model, start, usable, begin, begin_reserved)

    def peak(c: Config) -> int:
        got = measure(c)
        return got[0] if got is not None else 1 << 62

    def reserved(c: Config) -> int:
        got = measure(c)
        return got[2] if got is not None else 1 << 62

    options, stats = ((), None)
    if held > usable:
        options, stats = search(model, start, gpu, usable, gpus=gpus, cost=cost, top=top, budget=budget,
                                max_changes=max_changes, model_name=model_name, measure=measure)
    steps: list[AdviceStep] = []
    skipped: list[tuple[str, str]] = []
    state = start
    for rung in RUNGS:
        if held <= usable:
            break
        proposal = _propose(rung, state, model, gpu, gpus, lambda c: reserved(c) <= usable)
        if isinstance(proposal, str):
            skipped.append((rung, proposal))
            continue
        new, action, note = proposal
        after = peak(new)
        if after >= now:
            skipped.append((rung, f"{action} saves nothing here: the peak is set by memory this rung does not change"))
            continue
        cost_frac = 1 - clock.seconds(state) / clock.seconds(new)
        held = measure.reserved(new)
        steps.append(AdviceStep(rung, action, now - after, after, cost_frac, _ladder_config(new), note,
                                reserved_bytes_after=held))
        state, now = new, after
    return Advice(model, step, impl, gpu, gpus, usable, begin, tuple(steps), tuple(skipped), held <= usable,
                  reserve, options, stats, start.command(model_name or model.name), parallel=par, finetune=finetune,
                  start_reserved_bytes=begin_reserved, fit_state=start_state,
                  flush=start_flush)


def _start_state(model: ModelSpec, start: Config, usable: int, allocated: int, reserved: int):
    """The start's fit state and flush replay (:func:`~trainmem.estimate.allocation_order.estimate_fit_state`);
    the estimate is run again and replayed only when the reserved peak is over ``usable`` and the allocated is not."""
    from trainmem.estimate.allocation_order import estimate_fit_state
    from trainmem.fits import fit_state
    if not reserved > usable >= allocated:
        return fit_state(reserved_bytes=reserved, usable_bytes=usable), None
    e = estimate(model, start.step, start.impl, None if start.par.is_single else start.par, finetune=start.finetune)
    return estimate_fit_state(e, usable)


def _ladder_config(c: Config) -> dict:
    p = c.par
    return {"micro_batch": c.step.batch, "grad_accum": c.step.grad_accum, "seq": c.step.seq,
            "attention": c.impl.attention, "recompute": c.impl.recompute, "dp": p.dp, "tp": p.tp,
            "sp": p.sp, "zero": p.zero, "offload": list(p.offload)}


def _propose(rung: str, s: Config, model: ModelSpec, gpu: GPU, gpus: int, fits) -> tuple[Config, str, str] | str:
    """The rung applied to ``s``, or why it does not apply."""
    step, impl, par = s.step, s.impl, s.par
    if rung == "attention":
        if impl.attention not in ("eager", "sdpa-math"):
            return f"attention is already {impl.attention} (no S×S matrix is saved)"
        fused = fused_attention(step, impl)
        if fused not in family_attentions(model.family):
            return f"{model.family} runs no {fused} attention ({', '.join(family_attentions(model.family))} only)"
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
        degrees = tp_degrees(model, step.seq, gpus, gpu.gpus_per_node)
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
                "shards model states only (beyond the usual fixes); activations are unchanged")
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
