"""What the page asks for, as pure functions of a parsed request: the estimate with its verdict
on the chosen GPU, and (slower, asked for separately) the largest micro-batch and sequence that
fit and the advisor's fixes.

The numbers are those of the commands the response names: ``estimate`` is ``trainmem estimate
--json`` for ``command_estimate``; ``advice`` is ``trainmem advise --json`` for ``command_advise``.
Fit is decided as ``plan`` and ``advise`` decide it (``estimate --memory-figure reserved``): the
reserved peak (the estimate replayed through the caching-allocator model,
:func:`trainmem.estimate.allocation_order.estimate_reserved`) against capacity − the GPU preset's
context (or ``reserve``) − NCCL buffers beyond one rank − ``reserve_fraction`` × capacity, an extra
margin, 0 by default (:meth:`trainmem.plan.hardware.Reserve.reserved_usable_bytes`). The response
names the figure (``fits.memory_figure``), states both peaks and the three-state verdict
(``fits.fit_state``, :data:`trainmem.fits.FIT_STATES`: ``fits_with_cache_flush`` when the step runs
only by the allocator flushing its cache, as ``estimate --gpu`` says).

Known limitations:
  - The advisor starts from data parallelism over ``gpus`` without fine-tuning, as ``trainmem
    advise`` does; the response's ``advice.start_peak_bytes`` says where it started.
  - The largest micro-batch and sequence keep every other setting, parallel degrees included, and
    search as ``trainmem sweep`` does (doubling then bisection, sequences in multiples of 64), with
    its two bounds: ``value`` fits, ``value_with_flush`` runs only by flushing the allocator cache
    (``measure.sweeps.bisect_max_runs``; equal where nothing past ``value`` runs).
    The search assumes the reserved peak grows with the value; the allocator model's does not
    always (Mistral-7B mem-efficient on H100, B=1: S=3584 models 84.9 GiB reserved, S=4096 76.0
    GiB), so the answer is a boundary the bisection found, as ``sweep --gpu``'s is.
"""

from __future__ import annotations

from dataclasses import replace

from trainmem.errors import TrainmemError
from trainmem.serve.request import Request, request_parser

__all__ = ["SCHEMA", "options", "estimate_response", "fit_response"]

SCHEMA = "trainmem.serve/1"


def _specs(req: Request):
    from trainmem.cliargs import finetune_from_args, parallel_from_args, specs_from_args

    model, step, impl = specs_from_args(req.args)
    return model, step, impl, parallel_from_args(req.args), finetune_from_args(req.args)


def _hardware(req: Request):
    from trainmem.plan.gpu_args import check_gpus, gpu_from_args, reserve_from_args

    gpu = gpu_from_args(req.args)
    check_gpus(gpu, req.args.gpus)
    return gpu, reserve_from_args(req.args, gpu)  # the preset's context, as plan/advise take it


def _reserved_peak(result, usable: int | None = None) -> int:
    """The allocator model's reserved peak; the allocated peak where that is over ``usable`` already
    (reserved >= allocated: the verdict is the same, and the replay is skipped, as advise skips it)."""
    from trainmem.estimate.allocation_order import estimate_reserved

    if usable is not None and result.peak_bytes > usable:
        return result.peak_bytes
    return estimate_reserved(result).reserved_bytes


def options() -> dict:
    """Presets, GPUs, every field's choices, default and help: what the page builds its form from."""
    from trainmem.plan.hardware import list_gpus, load_gpu
    from trainmem.report.html import COLORS
    from trainmem.specs.loaders import list_presets

    fields = {}
    for dest, a in request_parser().actions.items():
        default = getattr(a.default, "value", a.default)
        fields[dest] = {"flag": a.option_strings[-1], "choices": list(a.choices) if a.choices else None,
                        "default": default, "help": a.help or "", "boolean": a.nargs == 0}
    return {"schema": SCHEMA, "presets": list_presets(),
            "gpus": [{"name": n, "memory_bytes": load_gpu(n).memory_bytes} for n in list_gpus()],
            "fields": fields, "colors": COLORS}


def estimate_response(req: Request) -> dict:
    """The estimate (``trainmem estimate --json`` without the per-tensor items), the fits verdict
    on ``gpus`` × ``gpu`` and the phase chart."""
    from trainmem.estimate import estimate
    from trainmem.report.html import stacked_bars

    model, step, impl, par, ft = _specs(req)
    gpu, reserve = _hardware(req)
    result = estimate(model, step, impl, par, finetune=ft)
    usable = reserve.reserved_usable_bytes(gpu, req.args.gpus)
    held = _reserved_peak(result)
    state = _fit_state(result, usable)
    d = result.to_dict(items=False)
    phases = d["phases"]
    chart = stacked_bars([(p["name"], p["parts"]) for p in phases], mark=d["peak_phase"],
                         title=f"{model.name}: live bytes per phase of the step")
    return {"schema": SCHEMA, "command_estimate": req.command("estimate"), "command_advise": req.command("advise"),
            "estimate": d, "chart_svg": chart,
            "fits": {"gpu": gpu.name, "gpus": req.args.gpus, "dp": req.args.dp, "memory_bytes": gpu.memory_bytes,
                     "reserve": reserve.to_dict(), "memory_figure": "reserved", "usable_bytes": usable,
                     "peak_bytes": result.peak_bytes, "peak_reserved_bytes": held,
                     "headroom_bytes": usable - held, "fits": held <= usable, "fit_state": state}}


def _fit_state(result, usable: int) -> str:
    """:data:`trainmem.fits.FIT_STATES` as ``estimate --gpu`` states it; an inference estimate (no
    allocation order to replay) by its allocated peak and the 5% share, as :func:`_reserved_peak` does."""
    from trainmem.estimate.allocation_order import estimate_fit_state
    from trainmem.estimate.inference import InferenceEstimate
    from trainmem.fits import fit_state

    if isinstance(result, InferenceEstimate):
        return fit_state(reserved_bytes=_reserved_peak(result), usable_bytes=usable)
    return estimate_fit_state(result, usable)[0]


def _largest(over: str, model, step, impl, par, ft, usable: int) -> dict:
    """The largest ``over`` (batch or seq) whose reserved peak fits ``usable`` (``value``), and the
    largest that runs, possibly only by flushing the allocator cache (``value_with_flush``, fit state
    not ``does_not_fit``), every other setting kept (``trainmem sweep --gpu``'s two bounds)."""
    from trainmem.estimate import estimate
    from trainmem.measure.sweeps import DEFAULT_MAX, DEFAULT_MULTIPLE, DEFAULT_START, bisect_max, bisect_max_runs

    stop = DEFAULT_MAX[over]
    if over == "seq" and model.max_positions:
        stop = min(stop, model.max_positions)
    states: dict[int, str] = {}

    def state(value: int) -> str:
        if value not in states:
            states[value] = _fit_state(estimate(model, replace(step, **{over: value}), impl, par, finetune=ft), usable)
        return states[value]

    multiple = DEFAULT_MULTIPLE[over]
    try:
        # from the current value: the answer is the same (peaks grow with the value), found sooner
        start = min(max(getattr(step, over), DEFAULT_START[over]), stop)
        value, capped = bisect_max(lambda v: state(v) == "fits", start=start, stop=stop, multiple=multiple)
        flush, capped_flush = bisect_max_runs(state, value, capped, stop=stop, multiple=multiple)
    except TrainmemError as exc:  # a value the search reached is refused (e.g. not divisible by tp)
        return {"value": None, "capped": False, "value_with_flush": None, "capped_with_flush": False,
                "why": f"{type(exc).__name__}: {exc}"}
    smallest = {"batch": "micro-batch", "seq": "sequence"}[over] + f" {multiple}"
    return {"value": value, "capped": capped, "value_with_flush": flush, "capped_with_flush": capped_flush,
            "why": "" if value else f"even {smallest} does not fit" + (" without flushing the allocator cache"
                                                                        if flush else "")}


def fit_response(req: Request) -> dict:
    """The largest micro-batch and sequence that fit, and the advisor's fixes (``trainmem advise``)."""
    from trainmem.plan.advise import advise

    model, step, impl, par, ft = _specs(req)
    gpu, reserve = _hardware(req)
    usable = reserve.reserved_usable_bytes(gpu, req.args.gpus)
    return {"schema": SCHEMA, "memory_figure": "reserved", "usable_bytes": usable,
            "largest": {over: _largest(over, model, step, impl, par, ft, usable) for over in ("batch", "seq")},
            "advice": advise(model, step, impl, gpu, gpus=req.args.gpus, reserve=reserve).to_dict(),
            "command_advise": req.command("advise")}
