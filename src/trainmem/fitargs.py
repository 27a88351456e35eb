"""``--gpu``, ``--gpu-memory`` and ``--memory-figure`` for the commands that print a peak
(estimate, trace, compare, sweep, profile): parsing around :mod:`trainmem.fits`; the lines they
print are rendered by :mod:`trainmem.report.fit_text`."""

from __future__ import annotations

import argparse

from trainmem.fits import FIGURES
from trainmem.report.fit_text import render_figure, render_verdict
from trainmem.report.units import fmt_bytes
from trainmem.units import SIZE_RULE, describe_size

__all__ = ["add_fit_args", "gpu_from_args", "check_figure_args", "fit_report", "estimate_fit",
           "sweep_budget", "sweep_fit", "profile_fit", "size_readings"]

#: The size flags a command may take, as ``args`` attribute -> the label of the line saying how it was read.
_SIZE_FLAGS = {"budget": "budget", "gpu_memory": "gpu memory", "reserve": "reserve",
               "gpu_intra_bw": "intra-node bandwidth (per s)", "gpu_inter_bw": "inter-node bandwidth (per s)"}


def size_readings(args) -> list[str]:
    """One line per size the user typed, saying how it was read (``budget: 80GB = 80,000,000,000
    bytes = 74.51 GiB``): ``80G`` is binary, ``80GB`` decimal (:data:`trainmem.units.SIZE_RULE`)."""
    return [f"{label}: " + ("0 bytes" if str(value).strip() in ("0", "0B") else describe_size(value, field=name))
            for name, label in _SIZE_FLAGS.items() if (value := getattr(args, name, None)) is not None]


def add_fit_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--gpu", metavar="NAME", default=None,
                   help="say whether the step fits on this accelerator (a preset, or custom with --gpu-memory)")
    p.add_argument("--gpu-memory", metavar="SIZE", default=None,
                   help=f"override or set (custom) the device memory, e.g. 80GiB ({SIZE_RULE})")
    p.add_argument("--memory-figure", choices=FIGURES, default="allocated",
                   help="the figure a peak is stated in: allocated, active (torchtune's), reserved "
                        "(max_memory_reserved) or device (nvidia-smi: reserved + CUDA context); default allocated")


def gpu_from_args(args):
    """The accelerator of ``--gpu`` (memory only: no TFLOP/s needed), or None."""
    from trainmem.errors import SpecError
    from trainmem.plan.hardware import load_gpu
    from trainmem.units import parse_size

    if args.gpu is None:
        if args.gpu_memory is not None:
            raise SpecError("gpu_memory", args.gpu_memory, "needs --gpu (a preset, or custom)")
        return None
    memory = None if args.gpu_memory is None else parse_size(args.gpu_memory, field="gpu_memory")
    return load_gpu(args.gpu, memory_only=True, memory_bytes=memory)


def check_figure_args(args, *, reserved_known: bool, unmodelled: str = "not modelled for estimates") -> None:
    """``device`` needs a GPU (its context); ``reserved`` too where nothing models the allocator."""
    from trainmem.errors import SpecError

    figure = args.memory_figure
    if args.gpu is None and (figure == "device" or figure == "reserved" and not reserved_known):
        what = "the CUDA context is per GPU preset" if figure == "device" else \
            f"the allocator reserve is then a share of the GPU's capacity: {unmodelled}"
        raise SpecError("memory_figure", figure, f"needs --gpu ({what})")


def fit_report(args, *, allocated_bytes: int, reserved_bytes: int | None = None, active_bytes: int | None = None,
               reserved_source: str = "", active_note: str = "", gpus: int = 1, label: str = "",
               unmodelled: str = "not modelled for estimates", paged_bytes: int = 0,
               flush=None, state=None) -> tuple[dict, str]:
    """The JSON fields (``fits``, ``memory_figure``) and the text lines for one peak. ``paged_bytes``:
    bitsandbytes' paged optimizer state, in the ``device`` figure as far as it stays resident;
    ``flush``: a callable ``usable -> FlushReplay | None`` (the estimate's allocation order replayed
    with the allocator's release-and-retry), which decides ``fits_with_cache_flush``; ``state``: a
    callable ``usable -> fit state`` decided elsewhere (a measurement), used as given."""
    from trainmem.fits import context_bytes, verdict

    check_figure_args(args, reserved_known=reserved_bytes is not None, unmodelled=unmodelled)
    figure, gpu = args.memory_figure, gpu_from_args(args)
    if gpu is not None:
        v = verdict(gpu, allocated_bytes=allocated_bytes, reserved_bytes=reserved_bytes, active_bytes=active_bytes,
                    reserved_source=reserved_source, figure=figure, gpus=gpus, unmodelled=unmodelled,
                    paged_bytes=paged_bytes, flush=None if flush is None else flush(gpu, gpus),
                    state=None if state is None else state(gpu.memory_bytes - context_bytes(gpu, gpus)))
        return {"memory_figure": _figure_json(figure, v.need_bytes), "fits": v.to_dict()}, \
            "\n".join([*size_readings(args), render_verdict(v, label=label)])
    if figure == "allocated":  # the default, named on every peak line already: JSON unchanged
        return {}, ""
    nbytes = {"allocated": allocated_bytes, "active": allocated_bytes if active_bytes is None else active_bytes,
              "reserved": reserved_bytes}[figure]
    note = {"active": active_note if active_bytes is None else "", "reserved": reserved_source}.get(figure, "")
    return {"memory_figure": _figure_json(figure, nbytes)}, label + render_figure(figure, nbytes, note)


def _figure_json(figure: str, nbytes: int | None) -> dict:
    """``{"figure": "reserved", "peak_reserved_bytes": n}``: the peak named as in every result (trainmem.schemas)."""
    from trainmem.schemas import figure_key
    return {"figure": figure, figure_key(figure): nbytes}


def estimate_fit(args, result, *, label: str = "") -> tuple[dict, str]:
    """``estimate``: the peak rank's allocated bytes; reserved from the estimate's allocation order
    replayed through the caching-allocator model (:mod:`trainmem.estimate.allocation_order`), only
    when a GPU or the reserved/device figure asks for it; the stated share of capacity where that
    model cannot run (an inference estimate, which has no training step's order)."""
    par = getattr(result, "parallel", None)
    reserved, source, unmodelled, flush = None, "", "not modelled for estimates", None
    if args.gpu is not None or args.memory_figure in ("reserved", "device"):
        from trainmem.estimate.inference import InferenceEstimate
        if not isinstance(result, InferenceEstimate):
            from trainmem.estimate.allocation_order import estimate_reserved
            model = estimate_reserved(result)
            reserved, source = model.reserved_bytes, model.source
            flush = _estimate_flush(result)
        else:
            unmodelled = "no allocation order for an inference estimate"
    return fit_report(args, allocated_bytes=result.peak_bytes, gpus=par.world_size if par is not None else 1,
                      label=label, reserved_bytes=reserved, reserved_source=source, unmodelled=unmodelled,
                      active_note="equals allocated: the estimator has no freed blocks still in use by another stream",
                      paged_bytes=_paged_bytes(result), flush=flush)


def _estimate_flush(result):
    """``gpu, gpus -> FlushReplay | None`` for a training estimate: the flush replay at capacity −
    context, run only where it decides the state (:func:`~trainmem.estimate.allocation_order.estimate_fit_state`)."""
    from trainmem.estimate.allocation_order import estimate_fit_state
    from trainmem.fits import context_bytes
    return lambda gpu, gpus: estimate_fit_state(result, gpu.memory_bytes - context_bytes(gpu, gpus))[1]


def _paged_bytes(result) -> int:
    """The peak rank's paged optimizer state (``Category.PAGED_STATE``), 0 where there is none."""
    return int(getattr(result, "totals_bytes", {}).get("paged_optimizer_state", 0))


def sweep_budget(args, *, reserve_modelled: bool, gpus: int = 1,
                 source: str = "from the back-end's allocator") -> tuple[int, str]:
    """``sweep``: the budget in bytes from ``--budget`` or ``--gpu`` (the usable memory, said in a line);
    ``gpus``: the ranks of the swept layout (NCCL's buffers beyond one), as ``estimate`` counts them."""
    from trainmem.errors import SpecError
    from trainmem.fits import ESTIMATE_RESERVE_FRACTION, budget_bytes, context_bytes
    from trainmem.units import parse_size

    if args.budget is not None and args.gpu is not None:
        raise SpecError("budget", args.budget, "give --budget or --gpu, not both (--gpu sets the budget to "
                                               "the GPU's usable memory)")
    check_figure_args(args, reserved_known=reserve_modelled)
    gpu = gpu_from_args(args)
    if gpu is None:
        if args.budget is None:
            raise SpecError("budget", None, "needs --budget SIZE or --gpu NAME")
        return parse_size(args.budget, field="budget"), "\n".join(size_readings(args))
    budget = budget_bytes(gpu, reserve_modelled=reserve_modelled, gpus=gpus)
    ctx = context_bytes(gpu, gpus)
    parts = (f"{fmt_bytes(gpu.memory_bytes)} capacity − {fmt_bytes(ctx)} CUDA context"
             f"{' + NCCL buffers' if gpus > 1 else ''} (an estimate)")
    if reserve_modelled:
        what = f"reserved, {source}"
    else:
        what = "allocated"
        parts += (f" − {fmt_bytes(gpu.memory_bytes - ctx - budget)} allocator reserve "
                  f"{ESTIMATE_RESERVE_FRACTION:.0%} of capacity (fragmentation, not modelled for estimates)")
    return budget, f"budget: the usable memory on 1× {gpu.name}, {fmt_bytes(budget)} {what} = {parts}"


def sweep_fit(args, result, *, reserve_modelled: bool, gpus: int = 1,
              source: str = "from the back-end's allocator") -> tuple[dict, str]:
    """``sweep --gpu``: the verdict at the largest value that fits, at the next value tried, and at the
    largest value that runs only by flushing the allocator cache (``fits_with_flush``, where that
    second bound is past both)."""
    if args.gpu is None:
        return {}, ""
    points = [p for p in result.points if p.peak_bytes is not None]
    fit = [p for p in points if p.fits]
    at = fit[-1] if fit else (points[0] if points else None)
    after = next((p for p in points if at is not None and at.fits and p.value > at.value and not p.fits), None)
    bound = getattr(result, "max_fit_with_flush", None)
    flushed = next((p for p in points if p.value == bound and p not in (at, after)
                    and p.fit_state == "fits_with_cache_flush"), None)
    out, lines = {}, []
    for key, p in (("fits", at), ("fits_next", after), ("fits_with_flush", flushed)):
        if p is None:
            continue
        d, text = fit_report(args, allocated_bytes=p.peak_bytes,
                             reserved_bytes=p.reserved_bytes if reserve_modelled else None,
                             reserved_source=source, gpus=gpus, label=f"{result.over}={p.value}: ",
                             flush=lambda _gpu, _gpus, p=p: p.flush)
        out[key] = d["fits"]
        lines.append(text)
    return out, "\n".join(lines)


def profile_fit(args, result) -> tuple[dict, str]:
    """``profile``: measured allocated, active and (CUDA) reserved bytes of the rank with the highest peak.
    On CUDA the state is the measurement's (:func:`trainmem.fits.measured_fit_state`: the allocator's
    retries during the timed steps); on CPU (no reserved figure, no allocator) two answers."""
    from trainmem.fits import measured_fit_state

    r = max(result.ranks, key=lambda r: r.peak_bytes)
    state = None
    if r.peak_reserved_bytes is not None and r.num_alloc_retries is not None:
        def state(usable: int) -> str:
            return measured_fit_state(reserved_bytes=r.peak_reserved_bytes, usable_bytes=usable,
                                      alloc_retries=r.num_alloc_retries, ooms=r.num_ooms)
    fit, text = fit_report(args, allocated_bytes=r.peak_bytes, reserved_bytes=r.peak_reserved_bytes,
                           active_bytes=r.peak_active_bytes, gpus=len(result.ranks),
                           reserved_source="measured (max_memory_reserved)", unmodelled="not measured on CPU",
                           active_note="equals allocated: no CUDA stream, no freed blocks still in use", state=state)
    v = fit.get("fits", {})
    if v.get("fit_state") == "fits_with_cache_flush":
        text += (f"\n  measured on {r.device}: the caching allocator released its cached blocks and retried "
                 f"{r.num_alloc_retries}× during the timed steps (num_alloc_retries in torch.cuda.memory_stats()); "
                 f"the reserved peak above is with those flushes. It runs, slower")
    elif v and not v.get("fits") and r.peak_reserved_bytes is None:
        text += "\n  on CPU no allocator runs: whether a cache flush would let it run is not checked (trainmem trace --gpu replays it)"
    elif v and not v.get("fits"):
        text += ("\n  a measured step is not replayed at another capacity: whether a cache flush would let it run "
                 "is not checked (trainmem trace --gpu replays the traced step)")
    return fit, text
