"""One process's measurement of real steps (:func:`measure_step`): warm-up, timed steps with the
allocator's peaks, then one instrumented step for the ledgers, per-module peaks, per-tensor
activations, a CUDA memory history and, on request, the torch profiler's categories at the peak
(see :mod:`trainmem.measure.profiling`)."""

from __future__ import annotations

import contextlib
import time
from typing import Any, Callable

from trainmem.errors import UnsupportedError
from trainmem.measure.profile_result import RankProfile
from trainmem.trace.result import ModulePeak

__all__ = ["measure_step", "baseline_tensors", "root_probe", "process_rank", "HISTORY_MAX_ENTRIES"]

HISTORY_MAX_ENTRIES = 200_000
_PROFILER_CATEGORY = {"PARAMETER": "parameter", "OPTIMIZER_STATE": "optimizer_state", "INPUT": "input",
                      "TEMPORARY": "transient", "ACTIVATION": "activation", "GRADIENT": "gradient",
                      "AUTOGRAD_DETAIL": "autograd_detail", None: "unattributed"}


def _device_name(dev) -> str:
    import torch
    if dev.type == "cuda":
        return f"cuda:{dev.index} ({torch.cuda.get_device_name(dev)})"
    return "cpu"


def _sync(dev) -> None:
    import torch
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def baseline_tensors(model, optimizer, extra) -> list:
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
def root_probe(model, probe):
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


def measure_step(run: Callable[[Any], Any], *, model, optimizer, tokens_per_step: int | None, dev, steps: int,
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
    meter = CudaMeter(dev) if cuda else LiveSetMeter(baseline_tensors(model, optimizer, extra_baseline))
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
        rank=process_rank(), device=_device_name(dev),
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


def process_rank() -> int:
    """This process's rank in the default process group, 0 when not distributed."""
    import torch.distributed as dist
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
