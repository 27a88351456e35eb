"""Find the largest sequence length or micro-batch that fits a memory budget, and fit how
memory grows on the way.

Search: values are multiples of ``multiple``; starting at ``start`` the value doubles while it
fits, then the gap between the last value that fits and the first that does not is bisected.
Peak memory must not decrease as the value grows (true of all three back-ends).

Back-ends and what "fits" means:
  - ``estimate``: :func:`trainmem.estimate.estimate`'s peak <= budget (``fit_reserved``: its reserved
    peak, the estimate replayed through the caching-allocator model,
    :func:`trainmem.estimate.allocation_order.estimate_reserved`). Terms from its items.
  - ``trace``: :func:`trainmem.trace.trace_step` on fake tensors; the 512-byte rounded allocated
    peak <= budget. Terms from the traced items' shapes.
  - ``device``: real steps (:func:`trainmem.measure.profiling.profile_model`). On CUDA the
    allocator is capped at the budget (``set_per_process_memory_fraction``), so a step fits when
    it does not run out of memory and its reserved peak is within the budget; on CPU when the
    live-set peak is within the budget. An out-of-memory error is caught, memory is released
    and the search goes on. A step that ran only after the allocator released its cached blocks
    (``num_alloc_retries`` > 0) fits only by flushing the cache.

Two bounds: ``max_fit``, the largest value that fits (fit state ``fits``), and ``max_fit_with_flush``,
the largest that runs, possibly only by flushing the allocator cache (``fits_with_cache_flush``:
the estimate's allocation order or the trace's recording replayed at the budget with the
allocator's release-and-retry, or measured retries on CUDA; :func:`bisect_max_runs`). Where the
back-end decides in two states (an allocated budget, a CPU device run) they are equal.

Terms: ``attention_scores`` (naive attention's scores, probabilities and dropout masks: the
estimator's ``S·S`` items, or traced activations of shape (B, A, S, S)) and ``other_activations``.

Verdict: how activations grow *at the limit found* (:func:`growth_at`), not averaged over the
range, whose lower part may lie below the crossover: the local log-log exponent there and the
share of the activations that grows quadratically there; ``quadratic`` when the exponent is at
least :data:`~trainmem.measure.fit.QUADRATIC_EXPONENT` (for a·x² + b·x, a quadratic share of half).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Callable, Literal

from trainmem.errors import SpecError, UnsupportedError
from trainmem.inventory import LEDGERS, Category
from trainmem.measure import fit as F
from trainmem.specs import ImplSpec, ModelSpec, StepSpec
from trainmem.specs.step import default_seq

__all__ = ["sweep", "SweepPoint", "SweepResult", "SCHEMA", "BACKENDS", "estimate_crossover_seq", "bisect_max",
           "bisect_max_runs", "growth_at"]

SCHEMA = "trainmem.sweep/2"
BACKENDS = ("estimate", "trace", "device")
TERMS = ("attention_scores", "other_activations")
MIN_FIT_POINTS = 4
MIN_FIT_VALUE = {"seq": 8, "batch": 1}
DEFAULT_MAX = {"seq": 1 << 20, "batch": 1 << 16}
DEFAULT_START = {"seq": 128, "batch": 1}
DEFAULT_MULTIPLE = {"seq": 64, "batch": 1}


@dataclass(frozen=True)
class SweepPoint:
    value: int
    fits: bool
    peak_bytes: int | None  # None: the device ran out of memory
    totals_bytes: dict[str, int] = field(default_factory=dict)
    terms_bytes: dict[str, int] = field(default_factory=dict)
    reserved_bytes: int | None = None
    note: str = ""
    fit_state: str | None = None
    """:data:`trainmem.fits.FIT_STATES`; ``fits_with_cache_flush`` only on the estimate back-end
    deciding with the reserved peak (its allocation order replayed at the budget with the allocator's
    release-and-retry); ``fits`` is true only for ``fits``."""
    flush: Any = None
    """That replay (:class:`~trainmem.estimate.allocation_order.FlushReplay`), where it ran; not in the JSON."""

    def to_dict(self) -> dict:
        return {"value": self.value, "fits": self.fits, "fit_state": self.fit_state, "peak_bytes": self.peak_bytes,
                "peak_reserved_bytes": self.reserved_bytes, "totals_bytes": dict(self.totals_bytes),
                "terms_bytes": dict(self.terms_bytes), **({"note": self.note} if self.note else {})}


@dataclass(frozen=True)
class SweepResult:
    over: str
    backend: str
    budget_bytes: int
    max_fit: int | None
    capped: bool  # the largest value searched still fits
    points: tuple[SweepPoint, ...]
    fit: dict
    verdict: str
    crossover_seq: float | None
    crossover_source: str
    meta: dict = field(default_factory=dict)
    at_limit: dict = field(default_factory=dict)
    """Growth at the limit (:func:`growth_at`): ``value``, ``exponent``, ``quadratic_share``, ``source``."""
    model: Any = None
    """The swept model's spec (echoed in the header's inputs)."""
    max_fit_with_flush: int | None = None
    """The largest value that runs, possibly only by flushing the allocator cache (fit state ``fits``
    or ``fits_with_cache_flush``, :func:`bisect_max_runs`); >= ``max_fit``. Equal to it where the
    back-end decides in two states."""
    capped_with_flush: bool = False

    def to_dict(self) -> dict:
        from trainmem.schemas import header
        m = self.meta
        return {**header("sweep", model=self.model or m.get("model"), step=m.get("step"), impl=m.get("impl"),
                         parallel=m.get("parallel"), finetune=m.get("finetune")),
                "search": {k: m[k] for k in ("start", "stop", "multiple") if k in m}, "over": self.over,
                "backend": self.backend, "budget_bytes": self.budget_bytes, "max_fit": self.max_fit,
                "capped": self.capped, "max_fit_with_flush": self.max_fit_with_flush,
                "capped_with_flush": self.capped_with_flush,
                "points": [p.to_dict() for p in self.points], "fit": self.fit,
                "verdict": self.verdict, "at_limit": dict(self.at_limit),
                "crossover_seq": None if self.crossover_seq is None else round(self.crossover_seq, 1),
                "crossover_source": self.crossover_source}


def bisect_max(fits: Callable[[int], bool], *, start: int, stop: int, multiple: int) -> tuple[int | None, bool]:
    """Largest multiple of ``multiple`` up to ``stop`` for which ``fits`` holds (monotone):
    from ``start`` the value doubles while it fits, then the gap is bisected; when ``start``
    does not fit, the search goes down to ``multiple`` itself. Returns (value or None,
    whether ``stop`` itself fits)."""
    lo_k = -(-start // multiple)
    hi_k = stop // multiple
    if hi_k < 1:
        raise SpecError("max", stop, f"is below the smallest value searched ({multiple})")
    lo_k = min(lo_k, hi_k)
    good, bad = None, None
    k = lo_k
    while True:
        if fits(k * multiple):
            good = k
            if k == hi_k:
                return k * multiple, True
            k = min(2 * k, hi_k)
        else:
            bad = k
            break
    if good is None:
        if lo_k == 1 or not fits(multiple):
            return None, False
        good = 1
    while bad - good > 1:
        mid = (good + bad) // 2
        if fits(mid * multiple):
            good = mid
        else:
            bad = mid
    return good * multiple, False


def bisect_max_runs(state: Callable[[int], str], strict: int | None, capped: bool, *, stop: int,
                    multiple: int) -> tuple[int | None, bool]:
    """The second bound over the three fit states (:data:`trainmem.fits.FIT_STATES`): the largest
    multiple of ``multiple`` up to ``stop`` whose ``state`` is not ``does_not_fit`` (it fits, or runs
    only by flushing the allocator cache), searched as :func:`bisect_max` from ``strict``, the strict
    bound it returned (with ``capped``). Every value that fits also runs, so the search starts past
    ``strict``; :func:`bisect_max` has already evaluated that next value, so when it does not run
    either the bounds are equal and nothing new is evaluated. Returns (value or None, whether
    ``stop`` itself runs)."""
    if capped:
        return strict, True
    nxt = (strict or 0) + multiple
    if nxt > stop or state(nxt) == "does_not_fit":
        return strict, False
    return bisect_max(lambda v: state(v) != "does_not_fit", start=nxt, stop=stop, multiple=multiple)


# --------------------------------------------------------------------------------------------
def _is_scores(item, seq: int) -> bool:
    """Estimator items have two sequence axes in their dims; traced items (which have no dims)
    are recognised by a 4-D (B, A, S, S) shape, so a (B, S, H) tensor with H = S is not taken."""
    if not item.dims:
        return len(item.shape) == 4 and item.shape[-1] == seq and item.shape[-2] == seq
    return sum(d == "S" for d in item.dims) >= 2


def _split_terms(items, seq: int) -> dict[str, int]:
    q = o = 0
    for it in items:
        if it.category is not Category.ACTIVATION:
            continue
        if _is_scores(it, seq):
            q += it.bytes
        else:
            o += it.bytes
    return {"attention_scores": q, "other_activations": o}


def estimate_crossover_seq(model: ModelSpec, step: StepSpec, impl: ImplSpec, parallel=None,
                           finetune=None) -> float | None:
    """From the estimator's items: the S where the S·S activations equal the others.
    Items are a·S² (scores) and b·S (the rest) at fixed batch, so S* = S·other/scores."""
    from trainmem.estimate import estimate

    e = estimate(model, step, impl, parallel, finetune=finetune)
    t = _split_terms(e.inventory, step.seq)
    if t["attention_scores"] == 0:
        return None
    return step.seq * t["other_activations"] / t["attention_scores"]


def _with(step: StepSpec, over: str, value: int) -> StepSpec:
    return replace(step, seq=value) if over == "seq" else replace(step, batch=value)


def _estimate_backend(model: ModelSpec, step: StepSpec, impl: ImplSpec, over: str, parallel=None, finetune=None,
                      reserved: bool = False, budget: int | None = None):
    """The estimator's peak of the rank with the highest peak when ``parallel`` is given; with
    ``reserved`` also its reserved peak from the allocator model (``estimate --memory-figure reserved``)
    and its fit state against ``budget`` (:func:`~trainmem.estimate.allocation_order.estimate_fit_state`)."""
    from trainmem.estimate import estimate
    from trainmem.estimate.allocation_order import estimate_fit_state, estimate_reserved

    def run(value: int) -> SweepPoint:
        s = _with(step, over, value)
        e = estimate(model, s, impl, parallel, finetune=finetune)
        state, flush = estimate_fit_state(e, budget) if reserved and budget is not None else (None, None)
        return SweepPoint(value, True, e.peak_bytes, e.totals_bytes, _split_terms(e.inventory, s.seq),
                          reserved_bytes=estimate_reserved(e).reserved_bytes if reserved else None,
                          fit_state=state, flush=flush)
    return run


def _trace_backend(source, step: StepSpec, impl: ImplSpec, over: str, reserved: bool = False,
                   budget: int | None = None):
    """The trace's peak; with ``reserved`` its fit state against ``budget`` from its own recorded
    stream replayed with the allocator's release-and-retry (:func:`trainmem.trace.flush.trace_fit_state`)."""
    from trainmem.trace import trace_step
    from trainmem.trace.flush import trace_fit_state

    def run(value: int) -> SweepPoint:
        s = _with(step, over, value)
        r = trace_step(source, s, impl)
        state, flush, _ = trace_fit_state(r, budget) if reserved and budget is not None else (None, None, "")
        return SweepPoint(value, True, r.peak_bytes, r.items.totals(), _split_terms(r.items, s.seq),
                          reserved_bytes=r.peak_reserved_bytes, fit_state=state, flush=flush)
    return run


class _DeviceBackend:
    def __init__(self, source, step, impl, over, budget, device, seed):
        from trainmem.measure.workload import resolve_device
        self.source, self.step, self.impl, self.over, self.budget, self.seed = source, step, impl, over, budget, seed
        self.device = resolve_device(device)

    def __enter__(self):
        import torch
        if self.device.type == "cuda":
            total = torch.cuda.get_device_properties(self.device).total_memory
            torch.cuda.set_per_process_memory_fraction(min(self.budget / total, 1.0), self.device)
        return self

    def __exit__(self, *exc):
        import torch
        if self.device.type == "cuda":
            torch.cuda.set_per_process_memory_fraction(1.0, self.device)

    def __call__(self, value: int) -> SweepPoint:
        from trainmem.measure.profiling import OutOfMemory, profile_model

        s = _with(self.step, self.over, value)
        try:
            r = profile_model(self.source, s, self.impl, device=self.device, seed=self.seed, steps=1, warmup=1,
                              modules=False)
        except OutOfMemory as exc:
            return SweepPoint(value, False, None, note=str(exc))
        rank = r.ranks[0]
        peak = rank.peak_bytes
        held = rank.peak_reserved_bytes if rank.peak_reserved_bytes is not None else peak
        # CUDA, capped at the budget: a step that ran after the allocator released its cached blocks
        # (num_alloc_retries, c10/cuda/CUDACachingAllocator.cpp DeviceCachingAllocator::malloc) fits
        # only by flushing; its reserved peak is the one with the flushes
        flushed = bool(rank.num_alloc_retries) and not rank.num_ooms and held <= self.budget
        state = "fits_with_cache_flush" if flushed else None
        return SweepPoint(value, held <= self.budget and not flushed, peak, dict(rank.totals_bytes), {},
                          reserved_bytes=rank.peak_reserved_bytes, fit_state=state,
                          note=f"{rank.num_alloc_retries} allocator retries (cache flushes) measured" if flushed else "")


# --------------------------------------------------------------------------------------------
def _fits_of(points: list[SweepPoint]) -> dict:
    usable = [p for p in points if p.peak_bytes is not None]
    xs = [p.value for p in usable]
    out: dict = {"ledgers": {}, "terms": {}}
    for cat in LEDGERS:
        ys = [p.totals_bytes.get(cat.value, 0) for p in usable]
        out["ledgers"][cat.value] = F.fit_growth(xs, ys).to_dict()
    if usable and all(p.terms_bytes for p in usable):
        for term in TERMS:
            out["terms"][term] = F.fit_growth(xs, [p.terms_bytes.get(term, 0) for p in usable]).to_dict()
    out["peak"] = F.fit_growth(xs, [p.peak_bytes for p in usable]).to_dict()
    return out


def growth_at(fits: dict, points: tuple[SweepPoint, ...], value: int, over: str) -> dict:
    """How activations grow at ``value``: the local log-log exponent ``x·y'/y`` of the fitted
    ``y = a·x² + b·x + c`` (1 + the quadratic share when c = 0), and the share of the activations
    that grows quadratically — the S·S terms' bytes at that point when the back-end splits them
    (``source`` ``terms``), else ``a·x²/y`` of the fit (``fit:activation``)."""
    act = fits["ledgers"]["activation"]
    a, b, c = act["quadratic_coef"], act["linear_coef"], act["constant"]
    x = float(value)
    y = a * x * x + b * x + c
    exponent = (2 * a * x * x + b * x) / y if y > 0 else None
    point = next((p for p in points if p.value == value), None)
    terms = point.terms_bytes if point is not None else {}
    if over == "seq" and sum(terms.values()) > 0:
        share, source = terms["attention_scores"] / sum(terms.values()), "terms"
    else:
        share, source = (a * x * x / y if y > 0 else 0.0), "fit:activation"
    return {"value": value, "exponent": None if exponent is None else round(exponent, 6),
            "quadratic_share": share, "source": source}


def sweep(source, step: StepSpec | None = None, impl: ImplSpec | None = None, *,
          over: Literal["seq", "batch"] = "seq", budget_bytes: int, backend: str = "estimate",
          start: int | None = None, stop: int | None = None, multiple: int | None = None,
          device=None, seed: int = 0, parallel=None, finetune=None, fit_reserved: bool = False) -> SweepResult:
    """Largest ``over`` value whose peak fits ``budget_bytes``, with growth-law fits.

    ``parallel`` (a ParallelSpec) and ``finetune`` (a FinetuneSpec): the estimate back-end sweeps
    the per-rank peak of that layout and fine-tuning, as ``trainmem estimate`` reports it; the
    trace and device back-ends run one device and full training, and refuse them.

    ``fit_reserved``: compare the estimate's or trace back-end's reserved figure (the caching-allocator
    model) with the budget instead of the allocated peak (``sweep --gpu``: the budget is then the capacity
    less the context, :mod:`trainmem.fits`); the device back-end always compares reserved.

    ``source``: a :class:`ModelSpec` for the estimator (and the reference model on the other
    back-ends) or a ``config.json`` dict (a Hugging Face model; the estimator maps it to a spec).
    """
    from trainmem.specs.loaders import spec_from_hf_config

    if over not in ("seq", "batch"):
        raise SpecError("over", over, "must be 'seq' or 'batch'")
    if backend not in BACKENDS:
        raise SpecError("backend", backend, f"must be one of {', '.join(BACKENDS)}")
    if not isinstance(budget_bytes, int) or budget_bytes <= 0:
        raise SpecError("budget_bytes", budget_bytes, "must be a positive number of bytes")
    spec = source if isinstance(source, ModelSpec) else spec_from_hf_config(source)
    step = step or StepSpec(seq=default_seq(spec.max_positions))
    impl = impl or ImplSpec()
    start = start or DEFAULT_START[over]
    multiple = multiple or (min(DEFAULT_MULTIPLE[over], start) if over == "seq" else 1)
    if stop is None:
        stop = DEFAULT_MAX[over]
    if over == "seq" and spec.max_positions:
        stop = min(stop, spec.max_positions)  # the estimator refuses longer sequences
    for name, v in (("start", start), ("stop", stop), ("multiple", multiple)):
        if not isinstance(v, int) or v <= 0:
            raise SpecError(name, v, "must be a positive integer")
    if start > stop:
        raise SpecError("start", start, f"is past the largest value to try (max={stop})")

    if parallel is not None and parallel.is_single and parallel.pp == 1:
        parallel = None
    if backend != "estimate" and (parallel is not None or finetune is not None):
        what = "parallel degrees" if parallel is not None else "fine-tuning"
        raise SpecError("backend", backend, f"runs one device with every parameter trained: {what} need "
                                            "--backend estimate")
    seen: dict[int, SweepPoint] = {}
    if backend == "estimate":
        run, ctx = _estimate_backend(spec, step, impl, over, parallel, finetune, reserved=fit_reserved,
                                     budget=budget_bytes), None
    elif backend == "trace":
        if impl.profile == "reference" and not isinstance(source, ModelSpec):
            source = spec
        run, ctx = _trace_backend(source, step, impl, over, reserved=fit_reserved, budget=budget_bytes), None
    else:
        if impl.profile == "reference" and not isinstance(source, ModelSpec):
            source = spec
        ctx = _DeviceBackend(source, step, impl, over, budget_bytes, device, seed)
        run = ctx

    def evaluate(value: int) -> SweepPoint:
        if value not in seen:
            p = run(value)
            if p.peak_bytes is not None and backend != "device":
                held = p.reserved_bytes if fit_reserved and p.reserved_bytes is not None else p.peak_bytes
                p = replace(p, fits=held <= budget_bytes)
            if p.fit_state is None:  # two states where no allocation order is replayed at the budget
                p = replace(p, fit_state="fits" if p.fits else "does_not_fit")
            seen[value] = p
        return seen[value]

    if ctx is not None:
        ctx.__enter__()
    try:
        max_fit, capped = bisect_max(lambda v: evaluate(v).fits, start=start, stop=stop, multiple=multiple)
        max_flush, capped_flush = bisect_max_runs(lambda v: evaluate(v).fit_state, max_fit, capped, stop=stop,
                                                  multiple=multiple)
        # enough points for the fits: halve down from the smallest value seen
        v = min(seen)
        while sum(1 for p in seen.values() if p.peak_bytes is not None) < MIN_FIT_POINTS:
            v //= 2
            if v < MIN_FIT_VALUE[over]:
                break
            evaluate(v)
    finally:
        if ctx is not None:
            ctx.__exit__(None, None, None)

    points = tuple(sorted(seen.values(), key=lambda p: p.value))
    fits = _fits_of(points)
    limit = max_fit if max_fit is not None else min(p.value for p in points)  # nothing fits: the first value
    at_limit = growth_at(fits, points, limit, over)
    e = at_limit["exponent"]
    verdict = "quadratic" if e is not None and e >= F.QUADRATIC_EXPONENT else "linear"
    x_max = max((p.value for p in points if p.peak_bytes is not None), default=0)
    crossover, source_name = None, "none"
    if over == "seq" and fits["terms"]:
        crossover = F.crossover(fits["terms"]["attention_scores"]["quadratic_coef"],
                                fits["terms"]["other_activations"]["linear_coef"], x_max)
        source_name = "fit:terms"
    elif over == "seq":
        act = fits["ledgers"]["activation"]
        crossover = F.crossover(act["quadratic_coef"], act["linear_coef"], x_max)
        source_name = "fit:activation"
    else:
        try:
            crossover = estimate_crossover_seq(spec, step, impl, parallel, finetune)
            source_name = "estimate"
        except UnsupportedError:
            pass
    meta = {"model": spec.name, "step": step.to_dict(), "impl": impl.to_dict(), "start": start, "stop": stop,
            "multiple": multiple, "parallel": None if parallel is None else parallel.to_dict(),
            "finetune": None if finetune is None else finetune.to_dict()}
    return SweepResult(over, backend, budget_bytes, max_fit, capped, points, fits, verdict, crossover,
                       source_name, meta, at_limit, model=spec, max_fit_with_flush=max_flush,
                       capped_with_flush=capped_flush)
