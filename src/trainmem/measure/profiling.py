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

The instrumented step is :mod:`trainmem.measure.instrumented`; the result types are
:mod:`trainmem.measure.profile_result`.

Known limitations:
  - CPU has no reserved memory (``peak_reserved_bytes`` is None: "reserved n/a on CPU").
  - Per-module peaks are sampled at hook boundaries; a module's backward ends when the gradient
    of one of its inputs is computed, which for shared inputs is after all their consumers.
  - For a user step function the activation ledger also holds the forward's outputs.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable

from trainmem.errors import OutOfMemory
from trainmem.measure.instrumented import measure_step, root_probe
from trainmem.measure.profile_result import ProfileResult, RankProfile

__all__ = ["profile", "profile_workload", "profile_model", "OutOfMemory", "is_oom", "release_memory"]

#: on CPU, refuse steps whose estimated peak exceeds this share of physical memory
HOST_FRACTION = 0.8


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
        with root_probe(model, probe):
            return step_fn()

    with _oom_guard():
        mine = measure_step(run, model=model, optimizer=optimizer, tokens_per_step=tokens_per_step, dev=dev,
                        steps=steps, warmup=warmup, snapshot=snapshot, modules=modules, categories=categories,
                        extra_baseline=inputs, tensors=tensors)
    return ProfileResult(_gather(mine), {"source": "step_fn"})


def profile_workload(w, *, steps: int = 3, warmup: int = 1, snapshot: str | None = None, modules: bool = True,
                     categories: bool = False, tensors: bool = True) -> ProfileResult:
    """Profile a built :class:`~trainmem.measure.workload.Workload` (numerics of its first step kept)."""
    def run(probe):
        return w.run_step(probe, grad_norm=not w.grad_norms)

    with _oom_guard():
        mine = measure_step(run, model=w.model, optimizer=w.optimizer, tokens_per_step=w.tokens_per_step, dev=w.device,
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
