"""Check-then-measure, the part shared by the Trainer callback and :func:`trainmem.guard`.

Before the first step: the estimate's per-device reserved peak (the caching-allocator model,
:func:`trainmem.estimate.allocation_order.estimate_reserved`) against the device's usable memory
for that figure (capacity − the context − NCCL buffers beyond one rank − ``reserve.fraction``, an
extra margin, 0 by default: :meth:`~trainmem.plan.hardware.Reserve.reserved_usable_bytes`), the
verdict of ``estimate --memory-figure reserved``, ``plan`` and ``advise``, in three states
(:data:`trainmem.fits.FIT_STATES`: over usable, the estimate's allocation order is replayed at the
usable memory with the allocator's release-and-retry, ``estimate_fit_state``); ``advise``'s ladder
when it does not fit without flushing the allocator cache. After the first steps: the measured allocated peak beside the predicted
allocated peak (a ratio of like figures, not a verdict; CUDA's measured reserved peak is logged). Pure functions and result objects; rendering is in ``integrations.text``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace

from trainmem.errors import DoesNotFit, SpecError
from trainmem.estimate.allocation_order import FlushReplay
from trainmem.plan.advise import Advice
from trainmem.plan.hardware import GPU, Reserve
from trainmem.specs import ImplSpec, ModelSpec, ParallelSpec, StepSpec
from trainmem.specs.finetune import FinetuneSpec

__all__ = ["RunSpec", "Budget", "Check", "Measured", "GuardReport", "DoesNotFit", "resolve_budget",
           "check_run", "ON_OOM", "DEFAULT_TOLERANCE"]

ON_OOM = ("warn", "stop")
DEFAULT_TOLERANCE = 0.10
_RATES_FROM = "h100-80gb"  # advise's throughput costs need a rate; memory is the device's own


@dataclass(frozen=True, kw_only=True)
class RunSpec:
    """What a live run was read as, with where each value came from."""

    model: ModelSpec
    step: StepSpec
    impl: ImplSpec
    parallel: ParallelSpec = ParallelSpec()
    finetune: FinetuneSpec | None = None
    notes: tuple[str, ...] = ()

    def to_dict(self) -> dict:
        return {"model": self.model.name, "step": self.step.to_dict(), "impl": self.impl.to_dict(),
                "parallel": self.parallel.to_dict(), "finetune": self.finetune.to_dict() if self.finetune else None,
                "notes": list(self.notes)}


@dataclass(frozen=True)
class Budget:
    """The memory one device can give to tensors."""

    gpu: GPU
    usable_bytes: int
    reserve: Reserve
    source: str
    figure: str = "reserved"
    """The figure ``usable_bytes`` is for: the reserved peak (``plan``/``advise``'s)."""

    def to_dict(self) -> dict:
        return {"gpu": self.gpu.name, "memory_bytes": self.gpu.memory_bytes, "usable_bytes": self.usable_bytes,
                "reserve": self.reserve.to_dict(), "memory_figure": self.figure, "source": self.source}


def resolve_budget(*, gpu: str | None = None, gpu_memory: str | int | None = None, device=None,
                   reserve: Reserve | None = None, gpus: int = 1) -> Budget | None:
    """The device memory to check against: ``gpu_memory`` (a size, parsed by ``trainmem.units``),
    else a ``gpu`` preset, else a CUDA ``device``'s capacity; None when none is known (CPU, no
    argument). Usable is for a reserved peak on ``gpus`` ranks; ``reserve`` None is plan's and
    advise's default (:meth:`Reserve.modelled`: the preset's context, no extra margin). ``advise``'s throughput costs use the preset's rates, or H100-80GB's when only a
    size is known."""
    from trainmem.plan.hardware import load_gpu
    from trainmem.units import parse_size

    if gpu_memory is not None:
        memory = parse_size(gpu_memory, field="gpu_memory")
        base = load_gpu(gpu or _RATES_FROM, memory_bytes=memory)
        source = f"gpu_memory={gpu_memory}"
    elif gpu is not None:
        base = load_gpu(gpu)
        source = f"gpu={gpu}"
    elif device is not None and getattr(device, "type", None) == "cuda":
        import torch
        props = torch.cuda.get_device_properties(device)
        base = load_gpu(_RATES_FROM, memory_bytes=int(props.total_memory), name=props.name)
        source = f"torch.cuda.get_device_properties({device}).total_memory"
    else:
        return None
    reserve = Reserve.modelled(base) if reserve is None else reserve
    return Budget(base, reserve.reserved_usable_bytes(base, gpus), reserve, source)


@dataclass(frozen=True)
class Check:
    """The prediction for one run, before its first step."""

    run: RunSpec
    predicted_peak_bytes: int
    peak_phase: str
    budget: Budget | None
    advice: Advice | None
    notes: tuple[str, ...] = ()
    predicted_reserved_bytes: int | None = None
    """The reserved peak (allocator model) the verdict compares; None without a budget."""
    fit_state: str | None = None
    """:data:`trainmem.fits.FIT_STATES` against the budget (``estimate --gpu``'s answer); None without one."""
    flush: FlushReplay | None = None
    """``fits_with_cache_flush``: the replay at the usable memory with the allocator's release-and-retry
    (flushes per step, bytes freed, the reserved peak with them)."""

    @property
    def fits(self) -> bool | None:
        """Fits without flushing the allocator cache (the reserved peak within usable); None when
        there is no device memory to compare with. :attr:`fit_state` has the three-state answer."""
        return None if self.budget is None else self.predicted_reserved_bytes <= self.budget.usable_bytes

    @property
    def runs(self) -> bool | None:
        """The step runs, possibly only by flushing the cache (``fit_state`` is not ``does_not_fit``)."""
        return None if self.fit_state is None else self.fit_state != "does_not_fit"

    def to_dict(self) -> dict:
        return {"run": self.run.to_dict(), "predicted_peak_bytes": self.predicted_peak_bytes,
                "predicted_peak_reserved_bytes": self.predicted_reserved_bytes,
                "peak_phase": self.peak_phase, "budget": self.budget.to_dict() if self.budget else None,
                "fits": self.fits, "fit_state": self.fit_state,
                "flush": None if self.flush is None else asdict(self.flush),
                "advice": self.advice.to_dict() if self.advice else None,
                "notes": list(self.notes)}


def check_run(run: RunSpec, budget: Budget | None) -> Check:
    """Estimate ``run`` and compare its reserved peak with ``budget`` (for ``run``'s ranks), in three
    states (``estimate_fit_state``); when it does not fit without flushing the cache, ``advise``'s ladder."""
    from trainmem.estimate import estimate
    from trainmem.estimate.allocation_order import estimate_fit_state, estimate_reserved
    from trainmem.plan.advise import advise

    e = estimate(run.model, run.step, run.impl, None if run.parallel.is_single else run.parallel,
                 finetune=run.finetune)
    notes: list[str] = []
    advice, held, state, flush = None, None, None, None
    if budget is not None:
        world = run.parallel.world_size  # NCCL's buffers beyond one rank, as estimate counts them
        budget = replace(budget, usable_bytes=budget.reserve.reserved_usable_bytes(budget.gpu, world))
        held = estimate_reserved(e).reserved_bytes
        state, flush = estimate_fit_state(e, budget.usable_bytes)
    if budget is not None and held > budget.usable_bytes:
        if run.finetune is not None:
            notes.append("advise does not model fine-tuning yet: no fix proposed")
        else:
            if run.parallel.zero or run.parallel.fsdp or run.parallel.offload:
                notes.append("advise starts from plain data parallelism, not the run's sharding")
            advice = advise(run.model, run.step, run.impl, budget.gpu, gpus=run.parallel.dp, reserve=budget.reserve)
    return Check(run, e.peak_bytes, e.peak_phase, budget, advice, tuple(notes), predicted_reserved_bytes=held,
                 fit_state=state, flush=flush if state == "fits_with_cache_flush" else None)


@dataclass(frozen=True)
class Measured:
    """Peaks of the first steps on the device."""

    device: str
    source: str
    step_peaks_bytes: tuple[int, ...]
    peak_reserved_bytes: int | None = None  # CUDA only

    @property
    def peak_bytes(self) -> int:
        return max(self.step_peaks_bytes)

    def to_dict(self) -> dict:
        return {"device": self.device, "source": self.source, "step_peaks_bytes": list(self.step_peaks_bytes),
                "peak_bytes": self.peak_bytes, "peak_reserved_bytes": self.peak_reserved_bytes}  # schemas' name


@dataclass(frozen=True)
class GuardReport:
    """Predicted and measured side by side."""

    check: Check
    measured: Measured | None = None
    tolerance: float = DEFAULT_TOLERANCE
    notes: tuple[str, ...] = field(default=())

    @property
    def ratio(self) -> float | None:
        """measured ÷ predicted."""
        if self.measured is None or not self.check.predicted_peak_bytes:
            return None
        return self.measured.peak_bytes / self.check.predicted_peak_bytes

    @property
    def agrees(self) -> bool | None:
        r = self.ratio
        return None if r is None else abs(r - 1) <= self.tolerance

    def to_dict(self) -> dict:
        return {"check": self.check.to_dict(), "measured": self.measured.to_dict() if self.measured else None,
                "ratio": self.ratio, "tolerance": self.tolerance, "agrees": self.agrees, "notes": list(self.notes)}


def validate_options(on_oom: str, tolerance: float, steps: int, reserve: Reserve | None, *,
                     steps_field: str = "measure_steps") -> None:
    """The options shared by the callback and guard, each named when wrong."""
    if reserve is not None and not isinstance(reserve, Reserve):
        raise SpecError("reserve", reserve, "must be a trainmem.plan.hardware.Reserve")
    if on_oom not in ON_OOM:
        raise SpecError("on_oom", on_oom, f"must be one of {', '.join(ON_OOM)}")
    if isinstance(tolerance, bool) or not isinstance(tolerance, (int, float)) or not 0 <= tolerance < 10:
        raise SpecError("tolerance", tolerance, "must be a fraction such as 0.1 (10%)")
    if isinstance(steps, bool) or not isinstance(steps, int) or not 1 <= steps <= 1000:
        raise SpecError(steps_field, steps, "must be an integer from 1 to 1000")
