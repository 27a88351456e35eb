"""Measure real training steps: peaks, ledgers, per-module peaks, tokens/s, per rank.

A profile runs ``warmup`` steps (the first creates the optimizer state; none is measured),
then ``steps`` timed steps, then one instrumented step:

* timed steps give tokens/s and, on CUDA, the allocator's peaks (allocated, reserved, active)
  and the allocation retries and OOMs counted during them (peak statistics are reset after
  the warm-up);
* the instrumented step gives the ledgers (parameters, gradients, master weights, optimizer
  state; activations = bytes still allocated after the forward, only ``loss`` kept), the
  per-module peaks, on CUDA a recorded memory history dumped as a snapshot, and on CPU the
  peak itself (the live set: CPU tensors have no allocator statistics); during its first
  micro-batch's forward the activations are recorded tensor by tensor, metadata only
  (:mod:`trainmem.measure.tensors`), as ``items`` keyed like the estimate's and the trace's;
* with ``categories=True`` one more step runs under the torch profiler and its memory
  timeline says which category (parameter, gradient, activation, temporary...) held the peak.

Known limitations:
  - CPU has no reserved memory (``peak_reserved_bytes`` is None: "reserved n/a on CPU").
  - Per-module peaks are sampled at hook boundaries; a module's backward ends when the gradient
    of one of its inputs is computed, which for shared inputs is after all their consumers.
  - For a user step function the activation ledger also holds the forward's outputs.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from trainmem.errors import OutOfMemory, UnsupportedError
from trainmem.inventory import MemoryItem
from trainmem.trace.result import ModulePeak

__all__ = ["profile", "profile_workload", "profile_model", "ProfileResult", "RankProfile", "OutOfMemory",
           "SCHEMA", "is_oom", "release_memory"]

SCHEMA = "trainmem.profile/2"
HISTORY_MAX_ENTRIES = 200_000
#: on CPU, refuse steps whose estimated peak exceeds this share of physical memory
HOST_FRACTION = 0.8
_PROFILER_CATEGORY = {"PARAMETER": "parameter", "OPTIMIZER_STATE": "optimizer_state", "INPUT": "input",
                      "TEMPORARY": "transient", "ACTIVATION": "activation", "GRADIENT": "gradient",
                      "AUTOGRAD_DETAIL": "autograd_detail", None: "unattributed"}


def is_oom(exc: BaseException) -> bool:
    """CUDA's ``OutOfMemoryError`` or a CPU allocation failure."""
    try:
        import torch
        if isinstance(exc, torch.cuda.OutOfMemoryError):
            return True
    except ImportError:  # pragma: no cover
        pass
    text = str(exc)
    return isinstance(exc, (RuntimeError, MemoryError)) and (
        isinstance(exc, MemoryError) or "out of memory" in text.lower() or "can't allocate memory" in text
        or "DefaultCPUAllocator" in text)


def release_memory() -> None:
    import gc
    gc.collect()
    try:
        import torch
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    except ImportError:  # pragma: no cover
        pass


@dataclass(frozen=True)
class RankProfile:
    """One process's measurement. Bytes are what the allocator reports (CUDA) or the bytes of
    live storages (CPU); ``None`` where the device has no such number."""

    rank: int
    device: str
    peak_bytes: int
    peak_reserved_bytes: int | None
    peak_active_bytes: int | None
    num_alloc_retries: int | None
    num_ooms: int | None
    baseline_bytes: int
    """Allocated when the instrumented step starts: parameters, buffers, optimizer state, inputs."""
    context_bytes: int | None
    """Device memory in use but not reserved by the caching allocator (CUDA context, library workspaces)."""
    tokens_per_s: float | None
    step_time_s: float
    totals_bytes: dict[str, int]
    modules: tuple[ModulePeak, ...] = ()
    categories_at_peak_bytes: dict[str, int] | None = None
    losses: tuple[float, ...] = ()
    first_grad_norm: float | None = None
    snapshot: str | None = None
    items: tuple[MemoryItem, ...] = ()
    """The first micro-batch's activations, one per storage, keyed as the estimate's (``trainmem.join``)."""

    def to_dict(self) -> dict:
        return {
            "rank": self.rank, "device": self.device,  # /2: peak_bytes is the allocated peak, as everywhere
            "peak_bytes": self.peak_bytes, "peak_reserved_bytes": self.peak_reserved_bytes,
            "peak_active_bytes": self.peak_active_bytes, "num_alloc_retries": self.num_alloc_retries,
            "num_ooms": self.num_ooms, "baseline_bytes": self.baseline_bytes, "context_bytes": self.context_bytes,
            "tokens_per_s": self.tokens_per_s, "step_time_s": self.step_time_s,
            "totals_bytes": dict(self.totals_bytes),
            "modules": [m.to_dict() for m in self.modules],
            "categories_at_peak_bytes": self.categories_at_peak_bytes,
            "losses": list(self.losses), "first_grad_norm": self.first_grad_norm, "snapshot": self.snapshot,
            "items": [i.to_dict() for i in self.items],
        }

    @classmethod
    def from_dict(cls, d: dict) -> "RankProfile":
        d = dict(d)
        d["modules"] = tuple(ModulePeak(**m) for m in d.get("modules", ()))
        d["losses"] = tuple(d.get("losses", ()))
        from trainmem.measure.tensors import item_from_dict
        d["items"] = tuple(item_from_dict(i) for i in d.get("items", ()))
        return cls(**d)



@dataclass(frozen=True)
class ProfileResult:
    """Every rank's :class:`RankProfile` (one when not distributed)."""

    ranks: tuple[RankProfile, ...]
    meta: dict = field(default_factory=dict)

    @property
    def device(self) -> str:
        return self.ranks[0].device

    @property
    def peak_bytes(self) -> int:
        return max(r.peak_bytes for r in self.ranks)

    @property
    def peak_reserved_bytes(self) -> int | None:
        vals = [r.peak_reserved_bytes for r in self.ranks if r.peak_reserved_bytes is not None]
        return max(vals) if vals else None

    @property
    def tokens_per_s(self) -> float | None:
        """Throughput of the whole job (sum over ranks)."""
        vals = [r.tokens_per_s for r in self.ranks]
        return None if any(v is None for v in vals) else sum(vals)

    @property
    def totals_bytes(self) -> dict[str, int]:
        return self.ranks[0].totals_bytes

    @property
    def items(self) -> tuple[MemoryItem, ...]:
        """Rank 0's activations, tensor by tensor (:attr:`RankProfile.items`)."""
        return self.ranks[0].items

    def to_dict(self) -> dict:
        from trainmem.schemas import header
        m = self.meta
        return {**header("profile", model=m.get("model_name") or m.get("model"), step=m.get("step"),
                         impl=m.get("impl")),
                "meta": {("model_class" if k == "model" else k): v for k, v in m.items()
                         if k not in ("step", "impl", "model_name")},
                "device": self.device,
                "peak_bytes": self.peak_bytes, "peak_reserved_bytes": self.peak_reserved_bytes,
                "tokens_per_s": self.tokens_per_s, "totals_bytes": dict(self.totals_bytes),
                "items": [i.to_dict() for i in self.items],
                "ranks": [r.to_dict() for r in self.ranks]}


# --------------------------------------------------------------------------------------------
def _device_name(dev) -> str:
    import torch
    if dev.type == "cuda":
        return f"cuda:{dev.index} ({torch.cuda.get_device_name(dev)})"
    return "cpu"


def _sync(dev) -> None:
    import torch
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _baseline_tensors(model, optimizer, extra) -> list:
    out = []
    if model is not None:
        for p in model.parameters():
            out.append(p)
            if p.grad is not None:
                out.append(p.grad)
        out.extend(model.buffers())
    if optimizer is not None:
        for g in optimizer.param_groups:
            for p in g["params"]:
                out.append(p)
                if p.grad is not None:
                    out.append(p.grad)
        for s in optimizer.state.values():
            out.extend(v for v in s.values() if hasattr(v, "untyped_storage"))
    out.extend(extra)
    return out


@contextlib.contextmanager
def _grad_ledger(model):
    """Bytes of parameter gradients, seen as each one is accumulated."""
    seen: dict[int, int] = {}
    handles = []
    if model is not None:
        for p in model.parameters():
            if p.requires_grad:
                def hook(t):
                    if t.grad is not None:
                        st = t.grad.untyped_storage()
                        seen[st._cdata] = max(seen.get(st._cdata, 0), st.nbytes())
                handles.append(p.register_post_accumulate_grad_hook(hook))
    try:
        yield seen
    finally:
        for h in handles:
            h.remove()


@contextlib.contextmanager
def _root_probe(model, probe):
    """For a user step function: forward start/end of the model's first forward."""
    if model is None:
        yield
        return
    state = {"calls": 0}

    def pre(mod, args):
        if state["calls"] == 0:
            probe("forward_start")

    def post(mod, args, out):
        state["calls"] += 1
        if state["calls"] == 1:
            probe("forward_end")

    h1, h2 = model.register_forward_pre_hook(pre), model.register_forward_hook(post)
    try:
        yield
    finally:
        h1.remove()
        h2.remove()


def _categories(run, dev) -> dict[str, int]:
    """Bytes per profiler category at the peak of one step (torch profiler memory timeline)."""
    import torch
    from torch.profiler import ProfilerActivity
    from torch.profiler._memory_profiler import _CATEGORY_TO_INDEX, MemoryProfileTimeline

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
    with torch.profiler.profile(activities=acts, profile_memory=True, record_shapes=True, with_stack=True) as prof:
        run(None)
    _, sizes = MemoryProfileTimeline(prof._memory_profile())._coalesce_timeline(str(dev))
    if not sizes:
        return {}
    at = max(sizes, key=sum)
    out: dict[str, int] = {}
    for cat, i in _CATEGORY_TO_INDEX.items():
        name = _PROFILER_CATEGORY[cat.name if cat is not None else None]
        out[name] = out.get(name, 0) + int(at[i + 1])
    return out


def _measure(run: Callable[[Any], Any], *, model, optimizer, tokens_per_step: int | None, dev, steps: int,
             warmup: int, snapshot: str | None, modules: bool, categories: bool, extra_baseline=(),
             tensors: bool = True, inputs: dict | None = None) -> RankProfile:
    import torch

    from trainmem.measure.meters import CudaMeter, LiveSetMeter, ModulePeakHooks
    from trainmem.measure.tensors import ForwardTensors
    from trainmem.measure.workload import ledger_bytes

    if steps < 1:
        raise UnsupportedError(f"steps={steps}: at least one measured step is needed")
    cuda = dev.type == "cuda"
    if snapshot and not cuda:
        raise UnsupportedError("a memory snapshot needs CUDA (the allocator records it); on CPU use "
                               "`trainmem trace --snapshot` for a simulated one")
    for _ in range(warmup):
        run(None)
    # timed steps: clean (no hooks), allocator peaks on CUDA
    before = torch.cuda.memory_stats(dev) if cuda else {}
    _sync(dev)
    if cuda:
        torch.cuda.reset_peak_memory_stats(dev)
    t0 = time.perf_counter()
    for _ in range(steps):
        run(None)
    _sync(dev)
    elapsed = time.perf_counter() - t0
    stats = torch.cuda.memory_stats(dev) if cuda else {}

    # instrumented step
    marks: dict[str, int] = {}
    meter = CudaMeter(dev) if cuda else LiveSetMeter(_baseline_tensors(model, optimizer, extra_baseline))
    baseline = torch.cuda.memory_allocated(dev) if cuda else meter.current()

    # per-tensor activations: metadata only, so the meter's live set (the CPU peak) is unchanged
    record = ForwardTensors(model, inputs) if (tensors and model is not None) else None

    def probe(event: str) -> None:
        marks.setdefault(event, meter.current())
        if record is not None:
            record.on(event)

    hooks = ModulePeakHooks(model, meter) if (modules and model is not None) else None
    history = contextlib.nullcontext()
    if snapshot:
        history = _memory_history(snapshot)
    try:
        with _grad_ledger(model) as grads, history, meter:
            run(probe)
            if hooks:
                hooks.end_step()
    finally:
        if hooks:
            hooks.remove()
        if record is not None:
            record.close()
    totals = {"parameter": 0, "gradient": sum(grads.values()), "master_weight": 0, "optimizer_state": 0,
              "activation": max(marks.get("forward_end", 0) - marks.get("forward_start", 0), 0)}
    if model is not None:
        totals.update(ledger_bytes(model, optimizer))
    cats = _categories(run, dev) if categories else None
    mods = tuple(ModulePeak(n, hooks.forward.get(n, 0), hooks.backward.get(n, 0)) for n in hooks.order) if hooks else ()
    context = None
    if cuda:
        free, total = torch.cuda.mem_get_info(dev)
        context = max(total - free - torch.cuda.memory_reserved(dev), 0)

    def delta(key: str) -> int:
        return int(stats.get(key, 0) - before.get(key, 0))

    return RankProfile(
        rank=_rank(), device=_device_name(dev),
        peak_bytes=int(stats["allocated_bytes.all.peak"]) if cuda else meter.peak_bytes,
        peak_reserved_bytes=int(stats["reserved_bytes.all.peak"]) if cuda else None,
        peak_active_bytes=int(stats["active_bytes.all.peak"]) if cuda else None,
        num_alloc_retries=delta("num_alloc_retries") if cuda else None,
        num_ooms=delta("num_ooms") if cuda else None,
        baseline_bytes=int(baseline), context_bytes=context,
        tokens_per_s=(tokens_per_step * steps / elapsed) if tokens_per_step and elapsed > 0 else None,
        step_time_s=elapsed / steps, totals_bytes=totals, modules=mods, categories_at_peak_bytes=cats,
        snapshot=snapshot, items=record.items if record is not None else ())


@contextlib.contextmanager
def _memory_history(path: str):
    """Record the CUDA allocator's history during the block and dump it, whole, to ``path``."""
    import pickle

    import torch

    from trainmem.atomic import atomic_path

    torch.cuda.memory._record_memory_history(max_entries=HISTORY_MAX_ENTRIES)
    try:
        yield
        snap = torch.cuda.memory._snapshot()
        with atomic_path(path) as tmp:
            with open(tmp, "wb") as f:
                pickle.dump(snap, f)
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)


def _rank() -> int:
    import torch.distributed as dist
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _gather(mine: RankProfile) -> tuple[RankProfile, ...]:
    """Every rank's profile on every rank (``all_gather_object``: works on gloo and NCCL)."""
    import torch.distributed as dist
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return (mine,)
    out: list = [None] * dist.get_world_size()
    dist.all_gather_object(out, mine.to_dict())
    return tuple(RankProfile.from_dict(d) for d in out)


@contextlib.contextmanager
def _oom_guard():
    """Turn an allocation failure into :class:`OutOfMemory`, after releasing memory."""
    msg = None
    try:
        yield
    except Exception as exc:
        if not is_oom(exc):
            raise
        msg = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    if msg is not None:  # outside the handler, the traceback's frames (and their tensors) are gone
        release_memory()
        raise OutOfMemory(f"out of memory during a measured step ({msg[:200]}); memory was released")


# --------------------------------------------------------------------------------------------
def profile(step_fn: Callable[[], Any], *, model=None, optimizer=None, tokens_per_step: int | None = None,
            steps: int = 3, warmup: int = 1, device=None, snapshot: str | None = None, modules: bool = True,
            categories: bool = False, inputs=(), tensors: bool = True) -> ProfileResult:
    """Profile a user's training step ``step_fn()`` (forward, backward, optimizer step).

    ``model`` and ``optimizer`` give the ledgers and per-module peaks; ``tokens_per_step`` gives
    tokens/s; ``inputs`` are tensors alive across steps (counted in the CPU baseline).
    ``tensors``: record the activations of the model's first forward tensor by tensor (``items``).

    >>> # result = trainmem.measure.profile(step, model=model, optimizer=opt, tokens_per_step=B * S)
    """
    from trainmem.measure.workload import resolve_device

    dev = resolve_device(device) if not hasattr(device, "type") else device

    def run(probe):
        if probe is None:
            return step_fn()
        with _root_probe(model, probe):
            return step_fn()

    with _oom_guard():
        mine = _measure(run, model=model, optimizer=optimizer, tokens_per_step=tokens_per_step, dev=dev,
                        steps=steps, warmup=warmup, snapshot=snapshot, modules=modules, categories=categories,
                        extra_baseline=inputs, tensors=tensors)
    return ProfileResult(_gather(mine), {"source": "step_fn"})


def profile_workload(w, *, steps: int = 3, warmup: int = 1, snapshot: str | None = None, modules: bool = True,
                     categories: bool = False, tensors: bool = True) -> ProfileResult:
    """Profile a built :class:`~trainmem.measure.workload.Workload` (numerics of its first step kept)."""
    def run(probe):
        return w.run_step(probe, grad_norm=not w.grad_norms)

    with _oom_guard():
        mine = _measure(run, model=w.model, optimizer=w.optimizer, tokens_per_step=w.tokens_per_step, dev=w.device,
                        steps=steps, warmup=max(warmup, 1), snapshot=snapshot, modules=modules,
                        categories=categories, extra_baseline=[w.ids, *(w.masters or ())], tensors=tensors,
                        inputs={"input_ids": w.ids})
    mine = _with_numerics(mine, w)
    meta = {"step": w.step.to_dict(), "impl": w.impl.to_dict(), "model": type(getattr(w.model, "module", w.model)).__name__}
    return ProfileResult(_gather(mine), meta)


def _with_numerics(r: RankProfile, w) -> RankProfile:
    from dataclasses import replace
    return replace(r, losses=tuple(w.losses), first_grad_norm=w.grad_norms[0] if w.grad_norms else None)


def _check_host_memory(source, step, impl) -> None:
    import os

    from trainmem.errors import TrainmemError as _Err
    from trainmem.estimate import estimate
    from trainmem.report.units import fmt_bytes
    from trainmem.specs import ImplSpec, ModelSpec, StepSpec
    from trainmem.specs.loaders import spec_from_hf_config

    try:
        host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        spec = source if isinstance(source, ModelSpec) else spec_from_hf_config(source)
        peak = estimate(spec, step or StepSpec(), impl or ImplSpec()).peak_bytes
    except (_Err, ValueError, OSError, TypeError, AttributeError):
        return  # an nn.Module, or a config the estimator does not map: nothing to check against
    if peak > HOST_FRACTION * host:
        raise OutOfMemory(f"the estimated peak {fmt_bytes(peak)} exceeds {HOST_FRACTION:.0%} of this host's "
                          f"{fmt_bytes(host)}; measure fewer layers (--layers), a shorter --seq or a smaller --batch")


def profile_model(source, step=None, impl=None, *, device=None, seed: int = 0, **kwargs) -> ProfileResult:
    """Build :func:`~trainmem.measure.workload.build_workload` and profile it; memory is
    released afterwards (also after an out-of-memory error).

    On CPU a step whose estimated peak exceeds :data:`HOST_FRACTION` of the host's memory is
    refused with :class:`OutOfMemory` before anything is built: there the kernel's OOM killer,
    not an exception, would end the process."""
    from trainmem.measure.workload import build_workload, resolve_device

    dev = resolve_device(device) if not hasattr(device, "type") else device
    if dev.type == "cpu":
        _check_host_memory(source, step, impl)
    w = None
    try:
        with _oom_guard():
            w = build_workload(source, step, impl, device=dev, seed=seed)
        return profile_workload(w, **kwargs)
    finally:
        if w is not None:
            w.close()
        del w
        release_memory()
