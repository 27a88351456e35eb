"""``trainmem.largest_micro_batch``: the largest micro-batch that fits, predicted, without one OOM.

The search is ``measure.sweeps.bisect_max`` (double while it fits, then bisect) over the
estimate's per-rank peak (``plan.ranks.per_rank_peak``: parallelism and fine-tuning included) or
the trace's allocated peak on fake tensors (a Hugging Face config only). "Fits" means peak <=
usable memory: capacity less the reserve ``plan`` and ``advise`` use.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Mapping

from trainmem.errors import SpecError, UnsupportedError
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
    peak_bytes: int | None  # at ``batch``
    next_peak_bytes: int | None  # at ``batch + 1`` (None when capped)
    budget: Budget
    backend: str
    step: StepSpec  # the step searched (its batch is the first one tried)

    def to_dict(self) -> dict:
        return {"batch": self.batch, "capped": self.capped, "peak_bytes": self.peak_bytes,
                "next_peak_bytes": self.next_peak_bytes, "usable_bytes": self.budget.usable_bytes,
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
                        gpu_memory: str | int | None = None, reserve: Reserve = Reserve(),
                        backend: str = "estimate", max_batch: int = 1 << 16) -> BatchFit:
    """The largest micro-batch B whose predicted peak fits one device: peak(B) <= usable < peak(B + 1).

    ``model``: a ModelSpec, a preset name or ``config.json`` path, a config dict, or a
    transformers model. ``step`` gives everything but the batch (``seq`` overrides its sequence);
    ``gpu`` (a preset) and/or ``gpu_memory`` (a size) give the device.
    """
    from trainmem.measure.sweeps import bisect_max
    from trainmem.plan.ranks import per_rank_peak

    if backend not in BACKENDS:
        raise SpecError("backend", backend, f"must be one of {', '.join(BACKENDS)}")
    if isinstance(max_batch, bool) or not isinstance(max_batch, int) or not 1 <= max_batch <= 1 << 20:
        raise SpecError("max_batch", max_batch, "must be an integer from 1 to 1048576")
    budget = resolve_budget(gpu=gpu, gpu_memory=gpu_memory, reserve=reserve)
    if budget is None:
        raise SpecError("gpu_memory", None, "a device is needed: pass gpu= (a preset) or gpu_memory= (a size)")
    spec, config = _spec_and_config(model)
    step = step or StepSpec()
    if seq is not None:
        step = replace(step, seq=seq)
    impl = impl or ImplSpec()
    parallel = parallel or ParallelSpec()
    if backend == "trace":
        if config is None:
            raise UnsupportedError("backend=trace needs a Hugging Face config (a preset, config dict or model), "
                                   "not a ModelSpec")
        if finetune is not None or not parallel.is_single:
            raise UnsupportedError("backend=trace traces one device without fine-tuning: use backend=estimate")

    peaks: dict[int, int] = {}

    def peak(b: int) -> int:
        if b not in peaks:
            s = replace(step, batch=b)
            if backend == "trace":
                from trainmem.trace import trace_step
                peaks[b] = trace_step(config, s, impl).peak_bytes
            else:
                peaks[b] = per_rank_peak(spec, s, impl, parallel, finetune)
        return peaks[b]

    batch, capped = bisect_max(lambda b: peak(b) <= budget.usable_bytes, start=1, stop=max_batch, multiple=1)
    return BatchFit(batch, capped, peak(batch) if batch else None,
                    None if capped else peak((batch or 0) + 1), budget, backend, step)
