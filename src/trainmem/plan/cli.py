"""``trainmem plan``, ``advise`` and ``explain``: argument parsing and rendering only."""

from __future__ import annotations

import argparse
import json

from trainmem.cliargs import positive_int
from trainmem.plan.gpu_args import add_gpu_args, check_gpus, gpu_from_args, reserve_from_args

__all__ = ["add_parser", "run_plan", "run_advise", "run_explain"]


def _positive_int(flag: str):
    return positive_int(flag.lstrip("-"))


def _gpus_arg(text: str) -> int | str:
    if text.strip().lower() == "auto":
        return "auto"
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--gpus={text!r}: must be a positive integer or auto") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"--gpus={value}: must be a positive integer or auto")
    return value


def add_parser(subparsers) -> None:
    from trainmem.cliargs import DEFAULT_MODEL, OPTIMIZER_HELP, PRECISION_HELP, add_model_step_args, spec_default
    from trainmem.specs import ImplSpec, StepSpec
    from trainmem.specs.impl import ATTENTIONS, PROFILES, RECOMPUTES
    from trainmem.specs.step import DEFAULT_SEQ, LOSSES, OPTIMIZERS, PRECISIONS

    p = subparsers.add_parser("plan", help="search parallel layouts, kernels and recompute for the fastest that fit")
    p.add_argument("--model", default=DEFAULT_MODEL, help=f"preset name or config.json path (default {DEFAULT_MODEL})")
    p.add_argument("--seq", type=_positive_int("--seq"), default=None,
                   help=f"sequence length (default {DEFAULT_SEQ}, or the model's learned positions if fewer)")
    from trainmem.plan.count import BATCH_TOKENS, DEFAULT_MAX_GPUS

    p.add_argument("--global-batch", type=_positive_int("--global-batch"), default=None,
                   help="sequences per optimizer step, over all ranks (default: the smallest power of two "
                        f"with ≥ {BATCH_TOKENS:,} tokens, e.g. 128 at seq 8192)")
    p.add_argument("--gpus", type=_gpus_arg, required=True,
                   help="number of GPUs, or auto: the smallest count that fits (powers of two, whole nodes)")
    p.add_argument("--min-gpus", type=_positive_int("--min-gpus"), default=1, help="--gpus auto: fewest to try")
    p.add_argument("--max-gpus", type=_positive_int("--max-gpus"), default=DEFAULT_MAX_GPUS,
                   help=f"--gpus auto: most to try (default {DEFAULT_MAX_GPUS})")
    p.add_argument("--precision", choices=PRECISIONS, default=spec_default(StepSpec, "precision"), metavar="NAME",
                   help=f"{PRECISION_HELP} (default {spec_default(StepSpec, 'precision')})")
    p.add_argument("--optimizer", choices=OPTIMIZERS, metavar="NAME", default=spec_default(StepSpec, "optimizer"),
                   help=OPTIMIZER_HELP)
    p.add_argument("--loss", choices=LOSSES, default=spec_default(StepSpec, "loss"),
                   help="ce (full fp32 logits), chunked-ce, fused-ce; torchtune-chunked-ce, "
                   "litgpt-chunked-ce (the frameworks' own chunked losses: docs/losses.md)")
    p.add_argument("--profile", choices=PROFILES, default=spec_default(ImplSpec, "profile"),
                   help="whose saved set is modelled: hf, reference, megatron, traced (read off a fake-tensor "
                        "trace; --device cpu)")
    p.add_argument("--attention", choices=ATTENTIONS, action="append",
                   help="only these attention kernels (repeatable; default flash, mem-efficient, eager)")
    p.add_argument("--recompute", choices=RECOMPUTES[:3] + ("op",), action="append",
                   help="only these recompute modes (repeatable; default none, selective, full; op: "
                        "torchtitan's op-level policy, searched when named)")
    from trainmem.cliargs import _names
    from trainmem.plan.axes import AXES
    p.add_argument("--search", type=_names("search"), default=(), metavar="AXIS[,AXIS]",
                   help=f"also search these axes (off by default, each multiplies the estimator calls): "
                        f"{', '.join(AXES)}; combinations the estimator refuses are skipped with the reason")
    p.add_argument("--mfu", type=float, default=None, help="share of the bf16 peak large GEMMs reach (default 0.45)")
    p.add_argument("--top", type=_positive_int("--top"), default=5, help="configurations to show (default 5)")
    p.add_argument("--rejected", action="store_true", help="also list every rejected configuration and why")
    p.add_argument("--json", action="store_true", help="one JSON object (schema trainmem.plan/2)")
    p.add_argument("--html", metavar="FILE", help="write a self-contained HTML report")
    p.add_argument("--plot", metavar="FILE", help="memory against step time, the Pareto front marked (.png or .svg)")
    add_gpu_args(p, required=True, reserved_figure=True)
    from trainmem.cliargs import add_finetune_args
    add_finetune_args(p)
    p.set_defaults(func=run_plan)

    from trainmem.plan.advise import DEFAULT_BUDGET, DEFAULT_MAX_CHANGES

    a = subparsers.add_parser("advise", help="the cheapest changes that fit, ranked by throughput cost; and the "
                                             "usual fixes applied one by one, as the explanation")
    add_model_step_args(a)
    add_gpu_args(a, required=True, reserved_figure=True)
    a.add_argument("--gpus", type=_positive_int("--gpus"), default=None,
                   help="GPUs available, data parallel to start with (default 1, or the world size of --dp/--tp/...)")
    a.add_argument("--top", type=_positive_int("--top"), default=5,
                   help="fitting configurations that keep the training to show (default 5)")
    a.add_argument("--max-estimates", type=_positive_int("--max-estimates"), default=DEFAULT_BUDGET,
                   help=f"estimates the search may run (default {DEFAULT_BUDGET})")
    a.add_argument("--max-changes", type=_positive_int("--max-changes"), default=DEFAULT_MAX_CHANGES,
                   help=f"changes combined in one configuration (default {DEFAULT_MAX_CHANGES})")
    a.add_argument("--json", action="store_true", help="one JSON object (schema trainmem.advise/2)")
    from trainmem.cliargs import (add_finetune_args, add_float8_args, add_optimizer_args, add_parallel_args,
                                  add_routing_arg)
    add_routing_arg(a)
    add_optimizer_args(a)
    add_float8_args(a)
    add_parallel_args(a)
    add_finetune_args(a)
    a.set_defaults(func=run_advise)

    e = subparsers.add_parser("explain", help="follow-up questions (bytes per parameter, at 2·S, at 4 micro-batches, "
                                              "per ZeRO stage, inference) answered with your numbers")
    add_model_step_args(e)
    e.add_argument("--gpu", metavar="NAME", help="compare against this accelerator's memory")
    e.add_argument("--zero-ranks", type=_positive_int("--zero-ranks"), default=8,
                   help="data-parallel ranks for the ZeRO answer (default 8)")
    e.add_argument("--json", action="store_true", help="one JSON object (schema trainmem.explain/2)")
    e.set_defaults(func=run_explain)


def run_plan(args) -> int:
    from dataclasses import replace

    from trainmem.cliargs import finetune_from_args
    from trainmem.plan.cost import CostModel
    from trainmem.plan.search import SearchSpace, plan
    from trainmem.specs.loaders import load_model
    from trainmem.specs.step import default_seq

    from trainmem.plan.count import default_global_batch, smallest_fit

    if args.precision == "fsdp-bf16":  # every layout plan searches is ZeRO 0-3: nothing would be screened
        from trainmem.errors import SpecError
        raise SpecError("precision", args.precision, "is FSDP2's MixedPrecisionPolicy, and plan searches ZeRO "
                                                     "layouts (zero 0-3): estimate --dp N --fsdp full prices one layout")
    gpu = gpu_from_args(args)
    if args.gpus != "auto":
        check_gpus(gpu, args.gpus)
    space = SearchSpace()
    if args.attention:
        space = replace(space, attention=tuple(dict.fromkeys(args.attention)))
    if args.recompute:
        space = replace(space, recompute=tuple(dict.fromkeys(args.recompute)))
    if args.search:
        space = replace(space, axes=tuple(dict.fromkeys(args.search)))
    cost = CostModel() if args.mfu is None else CostModel(mfu=args.mfu)
    model = load_model(args.model)
    seq = default_seq(model.max_positions) if args.seq is None else args.seq
    global_batch, note = (args.global_batch, "") if args.global_batch else default_global_batch(seq)
    common = dict(seq=seq, global_batch=global_batch, gpu=gpu, precision=args.precision, optimizer=args.optimizer,
                  loss=args.loss, profile=args.profile, reserve=reserve_from_args(args, gpu),
                  cost=cost, space=space, top=args.top,
                  keep_rejected=args.rejected, finetune=finetune_from_args(args))
    if args.gpus == "auto":
        result = smallest_fit(model, min_gpus=args.min_gpus, max_gpus=args.max_gpus, **common)
    else:
        result = plan(model, gpus=args.gpus, **common)
    result = replace(result, global_batch_note=note)
    from trainmem.report.output import write_outputs
    write_outputs(result.to_dict(rejected=args.rejected), args, title=f"trainmem plan: {args.model}")
    if args.json:
        print(json.dumps(result.to_dict(rejected=args.rejected)))
    else:
        from trainmem.fitargs import size_readings
        from trainmem.report.plan_text import render_plan
        print("\n".join([*size_readings(args), render_plan(result, rejected=args.rejected)]))
    return 0


def run_advise(args) -> int:
    from trainmem.cliargs import finetune_from_args, parallel_from_args, specs_from_args
    from trainmem.plan.advise import advise

    model, step, impl = specs_from_args(args)
    gpu = gpu_from_args(args)
    parallel = parallel_from_args(args)
    check_gpus(gpu, args.gpus or (parallel.world_size if parallel else 1))
    result = advise(model, step, impl, gpu, gpus=args.gpus, parallel=parallel, finetune=finetune_from_args(args),
                    reserve=reserve_from_args(args, gpu), top=args.top, budget=args.max_estimates,
                    max_changes=args.max_changes,
                    model_name=args.model)
    if args.json:
        print(json.dumps(result.to_dict()))
    else:
        from trainmem.fitargs import size_readings
        from trainmem.report.plan_text import render_advice
        print("\n".join([*size_readings(args), render_advice(result)]))
    return 0


def run_explain(args) -> int:
    from trainmem.cliargs import specs_from_args
    from trainmem.plan.explain import explain
    from trainmem.plan.hardware import load_gpu

    model, step, impl = specs_from_args(args)
    gpu = load_gpu(args.gpu) if args.gpu else None
    result = explain(model, step, impl, gpu=gpu, zero_ranks=args.zero_ranks)
    if args.json:
        print(json.dumps(result.to_dict()))
    else:
        from trainmem.report.plan_text import render_explanation
        print(render_explanation(result))
    return 0
