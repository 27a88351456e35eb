"""``trainmem.largest_micro_batch``: the largest micro-batch that fits, predicted, without one OOM.

The search is ``measure.sweeps.bisect_max`` (double while it fits, then bisect) over the
estimate's per-rank peak (``plan.ranks.per_rank_peak``: parallelism and fine-tuning included) or
the trace's peak on fake tensors (a Hugging Face config only). "Fits" means the reserved peak (the
caching-allocator model's: ``estimate_reserved`` of the estimate, the trace's own replay) <= usable
memory for it: capacity − context − NCCL buffers beyond one rank − ``reserve.fraction`` (0 by
default), the verdict of ``plan``, ``advise`` and ``sweep --gpu``. A second search, from that batch,
finds the largest that runs only by flushing the allocator cache (:data:`trainmem.fits.FIT_STATES`
``fits_with_cache_flush``: over usable, but the allocation stream, the estimate's allocation order or
the trace's recording, replayed at the usable memory with the allocator's release-and-retry never
fails); both bounds are reported, ``batch`` (strict) and ``batch_with_flush``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import Any, Mapping

from trainmem.errors import SpecError, UnsupportedError
from trainmem.families import default_attention
from trainmem.integrations.check import Budget, resolve_budget
from trainmem.plan.hardware import Reserve
from trainmem.specs import ImplSpec, ModelSpec, ParallelSpec, StepSpec
from trainmem.specs.finetune import FinetuneSpec

__all__ = ["largest_micro_batch", "BatchFit", "BACKENDS"]

BACKENDS = ("estimate", "trace")


@dataclass(frozen=True)
class BatchFit:
    """``batch`` is None when even a micro-batch of 1 does not fit."""

    batch: int | None
    capped: bool  # ``max_batch`` itself fits
    peak_bytes: int | None  # at ``batch`` (allocated)
    next_peak_bytes: int | None  # at ``batch + 1`` (None when capped)
    budget: Budget
    backend: str
    step: StepSpec  # the step searched (its batch is the first one tried)
    reserved_bytes: int | None = None  # at ``batch``: the figure compared with usable
    next_reserved_bytes: int | None = None  # at ``batch + 1``
    batch_with_flush: int | None = None
    """The largest micro-batch that runs, possibly only by flushing the allocator cache (fit state
    ``fits`` or ``fits_with_cache_flush``); >= ``batch``. None when even 1 does not run."""
    capped_with_flush: bool = False  # ``max_batch`` itself runs with the flush
    flush: Any = None
    """At ``batch_with_flush`` when it is over usable: the
    :class:`~trainmem.estimate.allocation_order.FlushReplay` (flushes per step, bytes freed, reserved
    peak with them); None when it fits without flushing."""

    @property
    def fit_state(self) -> str:
        """The three-state answer at ``batch_with_flush`` (``does_not_fit`` when nothing runs)."""
        if self.batch_with_flush is None:
            return "does_not_fit"
        return "fits" if self.batch_with_flush == self.batch else "fits_with_cache_flush"

    def to_dict(self) -> dict:
        return {"batch": self.batch, "capped": self.capped, "peak_bytes": self.peak_bytes,
                "next_peak_bytes": self.next_peak_bytes, "peak_reserved_bytes": self.reserved_bytes,
                "next_peak_reserved_bytes": self.next_reserved_bytes,
                "batch_with_flush": self.batch_with_flush, "capped_with_flush": self.capped_with_flush,
                "fit_state": self.fit_state, "flush": None if self.flush is None else asdict(self.flush),
                "usable_bytes": self.budget.usable_bytes,
                "budget": self.budget.to_dict(), "backend": self.backend, "step": self.step.to_dict()}


def _spec_and_config(model) -> tuple[ModelSpec, Mapping[str, Any] | None]:
    from trainmem.integrations.read import base_model, model_spec_of
    from trainmem.specs.loaders import load_config_dict, spec_from_hf_config

    if isinstance(model, ModelSpec):
        return model, None
    if isinstance(model, str):
        cfg = load_config_dict(model)
        return spec_from_hf_config(cfg, name=model), cfg
    if isinstance(model, Mapping):
        return spec_from_hf_config(model), model
    return model_spec_of(model), base_model(model).config.to_dict()


def largest_micro_batch(model, *, seq: int | None = None, step: StepSpec | None = None,
                        impl: ImplSpec | None = None, finetune: FinetuneSpec | None = None,
                        parallel: ParallelSpec | None = None, gpu: str | None = None,
                        gpu_memory: str | int | None = None, reserve: Reserve | None = None,
                        backend: str = "estimate", max_batch: int = 1 << 16) -> BatchFit:
    """The largest micro-batch B whose predicted reserved peak fits one device: reserved(B) <= usable
    < reserved(B + 1) (``batch``), and the largest that runs only by flushing the allocator cache
    (``batch_with_flush``, :data:`trainmem.fits.FIT_STATES`).

    ``model``: a ModelSpec, a preset name or ``config.json`` path, a config dict, or a
    transformers model. ``step`` gives everything but the batch (``seq`` overrides its sequence);
    ``gpu`` (a preset) and/or ``gpu_memory`` (a size) give the device.
    """
    from trainmem.measure.sweeps import bisect_max

    if backend not in BACKENDS:
        raise SpecError("backend", backend, f"must be one of {', '.join(BACKENDS)}")
    if isinstance(max_batch, bool) or not isinstance(max_batch, int) or not 1 <= max_batch <= 1 << 20:
        raise SpecError("max_batch", max_batch, "must be an integer from 1 to 1048576")
    parallel = parallel or ParallelSpec()
    budget = resolve_budget(gpu=gpu, gpu_memory=gpu_memory, reserve=reserve, gpus=parallel.world_size)
    if budget is None:
        raise SpecError("gpu_memory", None, "a device is needed: pass gpu= (a preset) or gpu_memory= (a size)")
    spec, config = _spec_and_config(model)
    step = step or StepSpec()
    if seq is not None:
        step = replace(step, seq=seq)
    impl = impl or ImplSpec(attention=default_attention(spec.family))  # gpt-oss, Gemma-2: eager, as estimate()
    if backend == "trace":
        if config is None:
            raise UnsupportedError("backend=trace needs a Hugging Face config (a preset, config dict or model), "
                                   "not a ModelSpec")
        if finetune is not None or not parallel.is_single:
            raise UnsupportedError("backend=trace traces one device without fine-tuning: use backend=estimate")

    usable = budget.usable_bytes
    peaks: dict[int, tuple[int, int, str, Any]] = {}  # batch -> (allocated, reserved, fit state, flush replay)

    def peak(b: int) -> tuple[int, int, str, Any]:
        if b not in peaks:
            s = replace(step, batch=b)
            if backend == "trace":  # the trace's recorded stream, replayed at usable (trace/flush.py)
                from trainmem.trace import trace_step
                from trainmem.trace.flush import trace_fit_state
                t = trace_step(config, s, impl)
                state, flush, _ = trace_fit_state(t, usable)
                peaks[b] = (t.peak_bytes, t.peak_reserved_bytes, state, flush)
            else:  # the peak rank (plan.ranks.per_rank_peak's estimate), replayed through the allocator model
                from trainmem.estimate import estimate
                from trainmem.estimate.allocation_order import estimate_fit_state, estimate_reserved
                e = estimate(spec, s, impl, None if parallel.is_single else parallel, finetune=finetune)
                state, flush = estimate_fit_state(e, usable)
                peaks[b] = (e.peak_bytes, estimate_reserved(e).reserved_bytes, state, flush)
        return peaks[b]

    batch, capped = bisect_max(lambda b: peak(b)[1] <= usable, start=1, stop=max_batch, multiple=1)
    at, after = peak(batch) if batch else (None, None), (None, None) if capped else peak((batch or 0) + 1)
    # from the strict bound: every batch that fits also runs, so the second bound is never below it
    runs, runs_capped = (batch, True) if capped else bisect_max(lambda b: peak(b)[2] != "does_not_fit",
                                                                start=batch or 1, stop=max_batch, multiple=1)
    return BatchFit(batch, capped, at[0], after[0], budget, backend, step, reserved_bytes=at[1],
                    next_reserved_bytes=after[1], batch_with_flush=runs, capped_with_flush=runs_capped,
                    flush=peak(runs)[3] if runs and runs != batch else None)
