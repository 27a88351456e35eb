"""``trainmem profile`` and ``trainmem sweep``: parse, call :mod:`trainmem.measure`, render.

Outputs named with ``--out``/``--snapshot`` are written whole or not at all (temporary file,
then rename), so Ctrl-C or an out-of-memory error leaves no half-written file.
"""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import replace

from trainmem.cliargs import positive_int  # positive integers, one-line errors
from trainmem.units import SIZE_RULE

__all__ = ["add_parser", "run_profile", "run_sweep"]


MAX_LAYERS = 10_000  # past this --layers is a typo, and the estimate that guards the host would not finish
MAX_STEPS = 10**6    # a profile measures a few steps; more is a typo


def _upto(field: str, maximum: int):
    """Positive integers up to ``maximum``, one-line errors."""
    parse = positive_int(field)

    def bounded(text: str) -> int:
        value = parse(text)
        if value > maximum:
            raise argparse.ArgumentTypeError(f"--{field}={value}: at most {maximum}")
        return value
    bounded.__name__ = field
    return bounded


def _seed(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--seed={text!r}: must be an integer") from None
    if not -(2**63) <= value < 2**64:  # what torch.manual_seed takes
        raise argparse.ArgumentTypeError(f"--seed={value}: must fit in 64 bits")
    return value


def _common(p: argparse.ArgumentParser) -> None:
    from trainmem.cliargs import add_model_step_args

    add_model_step_args(p)
    p.add_argument("--layers", type=_upto("layers", MAX_LAYERS), default=None,
                   help="override the model's number of layers (measure a few layers of a large model)")
    p.add_argument("--run-on", choices=("auto", "cuda", "cpu"), default="auto",
                   help="device the steps run on (auto: CUDA when available); --device stays the kernels modelled")
    p.add_argument("--seed", type=_seed, default=0, help="seed for weights and token ids (default 0)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--out", metavar="FILE", help="also write the JSON to FILE (whole or not at all)")


def add_parser(subparsers) -> None:
    from trainmem.fitargs import add_fit_args

    p = subparsers.add_parser("profile", help="run real training steps and measure memory, speed and numerics")
    _common(p)
    p.add_argument("--steps", type=_upto("steps", MAX_STEPS), default=3, help="timed steps after the warm-up (default 3)")
    p.add_argument("--warmup", type=int, default=1, help="warm-up steps, not measured (default 1)")
    p.add_argument("--snapshot", metavar="FILE", help="CUDA: dump the recorded memory history (pytorch.org/memory_viz)")
    p.add_argument("--categories", action="store_true",
                   help="one more step under the torch profiler: bytes per category at the peak")
    p.add_argument("--no-modules", action="store_true", help="skip per-module peaks")
    p.add_argument("--top-modules", type=int, default=10, help="modules shown in the text report (default 10)")
    p.add_argument("--compare", action="store_true", help="estimate and trace of the same run, errors in percent")
    p.add_argument("--variants", metavar="SPEC",
                   help='settings side by side, e.g. "attention=eager,sdpa;recompute=none,full;batch=4x1,2x2"')
    add_fit_args(p)
    p.set_defaults(func=run_profile)

    s = subparsers.add_parser("sweep", help="largest sequence length or micro-batch within a memory budget")
    _common(s)
    s.add_argument("--over", choices=("seq", "batch"), required=True, help="what to vary")
    s.add_argument("--budget", metavar="SIZE",
                   help=f"memory budget, e.g. 80GiB, 512MiB (or --gpu: its usable memory); {SIZE_RULE}")
    add_fit_args(s)
    s.add_argument("--backend", choices=("estimate", "trace", "device"), default="estimate",
                   help="estimate (analytic), trace (fake tensors on CPU) or device (real runs); default estimate")
    s.add_argument("--start", type=positive_int("start"), default=None, help="first value (seq 128, batch 1)")
    s.add_argument("--max", type=positive_int("max"), default=None, dest="stop", help="largest value searched")
    s.add_argument("--multiple", type=positive_int("multiple"), default=None,
                   help="values are multiples of this (seq 64, batch 1)")
    s.add_argument("--html", metavar="FILE", help="write a self-contained HTML report")
    s.add_argument("--plot", metavar="FILE", help="memory against the swept value with the fits (.png or .svg)")
    from trainmem.cliargs import (add_finetune_args, add_float8_args, add_optimizer_args, add_parallel_args,
                                  add_routing_arg)
    add_routing_arg(s)
    add_optimizer_args(s)
    add_float8_args(s)
    add_parallel_args(s)  # the estimate back-end: per-rank peaks, as estimate reports them
    add_finetune_args(s)
    s.set_defaults(func=run_sweep)


# --------------------------------------------------------------------------------------------
def _source(args):
    """(source, step, impl): a ModelSpec for --profile reference, else a config.json dict."""
    from trainmem.cliargs import specs_from_args
    from trainmem.specs.loaders import load_config_dict

    spec, step, impl = specs_from_args(args)
    if args.profile == "reference":
        if args.layers:
            spec = replace(spec, num_layers=args.layers)
        return spec, step, impl
    cfg = load_config_dict(args.model)
    if args.layers:
        key = next((k for k in ("num_hidden_layers", "n_layer", "num_layers") if k in cfg), "num_hidden_layers")
        cfg = {**cfg, key: args.layers}
    return cfg, step, impl


def _emit(args, payload: dict, text: str | None) -> None:
    if getattr(args, "out", None):
        from trainmem.atomic import write_text_atomic
        from trainmem.report.output import say_wrote
        write_text_atomic(args.out, json.dumps(payload, indent=1) + "\n")
        say_wrote(args.out)
    if args.json:
        print(json.dumps(payload))
    elif text is not None:
        print(text)


def _distributed(device: str):
    """Initialise the process group under torchrun (WORLD_SIZE > 1); returns a closer."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return lambda: None
    import torch
    import torch.distributed as dist
    if dist.is_initialized():
        return lambda: None
    cuda = device != "cpu" and torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend="nccl" if cuda else "gloo")
    return dist.destroy_process_group


def _is_rank0() -> bool:
    try:
        import torch.distributed as dist
        return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0
    except ImportError:  # pragma: no cover
        return True


def run_profile(args: argparse.Namespace) -> int:
    from trainmem.measure.workload import resolve_device

    source, step, impl = _source(args)
    from trainmem.fitargs import gpu_from_args
    gpu_from_args(args)  # a bad --gpu before the steps run
    if not 0 <= args.warmup <= MAX_STEPS:
        from trainmem.errors import SpecError
        raise SpecError("warmup", args.warmup, f"must be between 0 and {MAX_STEPS}")
    variants = None
    if args.variants:  # checked before torch is imported
        from trainmem.measure.variants import parse_variants
        variants = parse_variants(args.variants, step, impl)
    close = _distributed(args.run_on)
    try:
        device = resolve_device(None if args.run_on == "auto" else args.run_on)
        impl = replace(impl, device=device.type)
        if variants is not None:
            from trainmem.report.measure_text import render_variants
            from trainmem.measure.variants import run_variants
            variants = [replace(v, impl=replace(v.impl, device=device.type)) for v in variants]
            result = run_variants(source, variants, device=device, seed=args.seed, steps=args.steps,
                                  warmup=max(args.warmup, 1))
            if _is_rank0():
                from trainmem.schemas import model_input, set_inputs
                payload = set_inputs(result.to_dict(), model=model_input(source, args.model), step=step, impl=impl,
                                     gpu=gpu_from_args(args))
                _emit(args, payload, render_variants(result))
            return 0
        from trainmem.measure.profiling import profile_model
        from trainmem.report.measure_text import render_profile
        kwargs = dict(steps=args.steps, warmup=args.warmup, snapshot=args.snapshot, modules=not args.no_modules,
                      categories=args.categories)
        result = profile_model(source, step, impl, device=device, seed=args.seed, **kwargs)
        from trainmem.schemas import model_input, set_inputs
        payload = set_inputs(result.to_dict(), model=model_input(source, args.model), gpu=gpu_from_args(args))
        text = render_profile(result, top_modules=args.top_modules)
        from trainmem.fitargs import profile_fit
        fit, fit_text = profile_fit(args, result)
        payload.update(fit)
        text += f"\n{fit_text}" if fit_text else ""
        if args.compare:
            from trainmem.measure.compare import compare_run
            from trainmem.report.measure_text import render_compare
            table, _ = compare_run(source, step, impl, measured=result)
            payload["compare"] = table.to_dict()
            text += "\n\nestimate vs trace vs measurement:\n" + render_compare(table)
        if _is_rank0():
            _emit(args, payload, text)
        return 0
    finally:
        close()


def run_sweep(args: argparse.Namespace) -> int:
    from trainmem.report.measure_text import render_sweep
    from trainmem.measure.sweeps import sweep
    from trainmem.fitargs import sweep_budget, sweep_fit

    source, step, impl = _source(args)
    device = None
    if args.backend == "device":
        from trainmem.measure.workload import resolve_device
        device = resolve_device(None if args.run_on == "auto" else args.run_on)
        impl = replace(impl, device=device.type)
    from trainmem.cliargs import finetune_from_args, parallel_from_args
    # --gpu: the allocator is modelled by the trace and the estimate (its allocation order), measured on CUDA
    modelled = args.backend in ("trace", "estimate") or device is not None and device.type == "cuda"
    parallel = parallel_from_args(args)
    ranks = parallel.world_size if parallel is not None and args.backend == "estimate" else 1
    from trainmem.estimate.allocation_order import SOURCE
    said = SOURCE if args.backend == "estimate" else "from the back-end's allocator"
    budget, budget_text = sweep_budget(args, reserve_modelled=modelled, gpus=ranks, source=said)
    result = sweep(source, step, impl, over=args.over, budget_bytes=budget, backend=args.backend, start=args.start,
                   stop=args.stop, multiple=args.multiple, device=device, seed=args.seed,
                   parallel=parallel, finetune=finetune_from_args(args),
                   fit_reserved=(args.gpu is not None or args.memory_figure == "reserved") and modelled)
    from trainmem.fitargs import gpu_from_args
    from trainmem.schemas import model_input, set_inputs
    payload = set_inputs(result.to_dict(), model=model_input(source, args.model), gpu=gpu_from_args(args))
    fit, fit_text = sweep_fit(args, result, reserve_modelled=modelled, gpus=ranks, source=said)
    payload.update(fit)
    from trainmem.report.output import write_outputs
    write_outputs(payload, args, title=f"trainmem sweep: {args.model}")
    _emit(args, payload, "\n".join(t for t in (budget_text, render_sweep(result), fit_text) if t))
    return 0
