"""``trainmem trace``: argument parsing and rendering around :func:`trainmem.trace.trace_step`."""

from __future__ import annotations

import argparse
import json
import sys

__all__ = ["add_parser", "run"]


def add_parser(subparsers) -> argparse.ArgumentParser:
    from trainmem.cliargs import (add_compile_arg, add_float8_args, add_model_step_args, add_optimizer_args,
                                  add_routing_arg)

    p = subparsers.add_parser("trace", help="run one training step on fake tensors and record every byte")
    add_model_step_args(p)
    from trainmem.cliargs import add_head_args
    add_head_args(p, ("lm", "mlm", "seq-cls", "token-cls", "seq2seq"))
    add_routing_arg(p)
    add_optimizer_args(p)
    add_compile_arg(p)
    add_float8_args(p)
    p.add_argument("--experts", choices=("grouped_mm", "eager", "batched_mm"), default=None,
                   help="transformers' experts_implementation for MoE models (default grouped_mm; eager is "
                        "the per-expert loop, whose memory depends on --routing)")
    p.add_argument("--real", action="store_true", help="real CPU tensors instead of fake ones (small models only)")
    p.add_argument("--snapshot", metavar="FILE", help="write a CUDA memory snapshot pickle (pytorch.org/memory_viz)")
    p.add_argument("--expandable-segments", action="store_true",
                   help="lay out the snapshot as the allocator does with expandable_segments:True")
    p.add_argument("--html", metavar="FILE", help="write a self-contained HTML timeline")
    p.add_argument("--plot", metavar="FILE", help="write the step timeline as a figure (.png or .svg)")
    p.add_argument("--json", action="store_true", help="print one JSON object (schema trainmem.trace/2)")
    p.add_argument("--progress", choices=("auto", "always", "never"), default="auto",
                   help="progress bar on stderr (auto: when stderr is a terminal)")
    from trainmem.fitargs import add_fit_args
    add_fit_args(p)
    from trainmem.cliargs import add_finetune_args, add_parallel_args
    add_finetune_args(p)  # lora, freeze and qlora traced (peft on the fake model; trace/qlora.py)
    add_parallel_args(p)  # --dp N --fsdp full traced as rank 0 (trace/parallel_fsdp.py); the rest refused in one line
    p.add_argument("--pp-rank", type=int, default=0, metavar="R",
                   help="with --pp: the pipeline rank traced (default 0; estimate --pp reports every stage's)")
    p.set_defaults(func=run)
    return p


def _bar(done: float, phase: str) -> None:
    width = 30
    filled = int(done * width)
    sys.stderr.write(f"\rtracing [{'#' * filled}{'.' * (width - filled)}] {done:4.0%} {phase:<10}")
    if done >= 1.0:
        sys.stderr.write("\n")
    sys.stderr.flush()


def routing_line(moe: dict) -> str:
    """The routing assumption a MoE trace ran under, in one line."""
    return (f"MoE routing: {moe['routing']} (assumed, not measured), experts_implementation={moe['experts_implementation']}, "
            f"{moe['num_experts']} experts, top-{moe['top_k']}, in {moe['experts_modules']} layers")


def trace_fit(args, result, *, label: str = "") -> tuple[dict, str]:
    """The verdict on the trace's own reserved figure (the caching-allocator model's replay), in three
    states: where the reserved peak is over usable, the trace's recorded stream is replayed at the
    usable memory with the allocator's release-and-retry (:mod:`trainmem.trace.flush`)."""
    from trainmem.fitargs import fit_report
    from trainmem.fits import context_bytes
    from trainmem.trace.flush import UNREPLAYED, trace_fit_state

    expandable = getattr(args, "expandable_segments", False)
    reserved = result.peak_reserved_expandable_bytes if expandable else result.peak_reserved_bytes
    unreplayed = []

    def flush(gpu, gpus):
        _, replay, why = trace_fit_state(result, gpu.memory_bytes - context_bytes(gpu, gpus),
                                         expandable_segments=expandable)
        unreplayed.append(why)
        return replay

    fit, text = fit_report(args, allocated_bytes=result.peak_bytes, reserved_bytes=reserved, label=label,
                           reserved_source="from the caching-allocator model's replay of the trace"
                                           + (", expandable_segments" if expandable else ""),
                           active_note="equals allocated: one stream, no freed blocks still in use", flush=flush,
                           paged_bytes=result.totals_at_peak_bytes.get("paged_optimizer_state", 0))
    if unreplayed and unreplayed[0]:  # over usable, and no stream to replay with the flush: two answers
        text += (f"\n  whether a cache flush would let it run is not checked: {UNREPLAYED[unreplayed[0]]}")
    return fit, text


def compile_line(c: dict) -> str:
    """What eager and torch.compile save for backward, in one line (``trace/compiled.py``)."""
    def mib(n: int) -> str:
        return f"{n / 2**20:.2f} MiB"
    return (f"saved for backward: eager {mib(c['saved_eager_bytes'])} ({c['saved_eager_tensors']} tensors), "
            f"compiled {mib(c['saved_compiled_bytes'])} ({c['saved_compiled_tensors']} tensors) "
            f"in {c['regions']} region(s){_SCOPE_WORDS.get(c.get('scope', 'model'), '')}, backend {c['backend']}")


#: ImplSpec.compile_scope in the trace's compile line (whole-model compile says nothing more)
_SCOPE_WORDS = {"block": " (blocks compiled alone)", "block-loss": " (blocks and loss compiled alone)"}


#: Parallel flags and the value that means "one device" (what the trace runs).
_ONE_DEVICE = {"dp": None, "tp": None, "cp": None, "ep": None, "pp": None, "virtual_stages": None,
               "microbatches": None, "fsdp_group": None, "sp": False, "cp_style": "ring", "schedule": "1f1b",
               "layer_split": None, "zero": 0, "fsdp": None, "no_reshard_after_forward": False}


#: What ``--fsdp`` traces beside it: FSDP2 over ``--dp`` ranks (trace/parallel_fsdp.py), HSDP's shard
#: group, and TP on a second mesh dimension (trace/parallel_2d.py).
_FSDP_FLAGS = ("dp", "fsdp", "no_reshard_after_forward", "fsdp_group", "tp", "sp")


def refuse_parallel(args: argparse.Namespace) -> tuple[str, ...]:
    """One line naming the first parallel flag given that the tracer cannot run: it runs one
    process, or with ``--fsdp`` rank 0 of FSDP2 in a fake process group (:func:`fsdp_spec`), so no
    other sharding or pipeline can happen in it (a degree of 1 is that device). Returns what
    ``--offload`` asks, activations only."""
    from trainmem.errors import UnsupportedError
    for name, single in _ONE_DEVICE.items():
        if getattr(args, "fsdp", None) and name in _FSDP_FLAGS:
            continue
        if _pipeline_alone(args) and name in _PP_FLAGS:
            continue  # one rank of torch.distributed.pipelining (pp_spec; trace/parallel_pp.py)
        if getattr(args, "tp", None) and name in ("tp", "sp"):
            continue  # tensor parallelism as rank 0 of N (tp_spec; trace/parallel_tp.py)
        value = getattr(args, name, single)
        if value != single and not (single is None and value == 1):
            flag = "--" + name.replace("_", "-")
            shown = "" if isinstance(value, bool) else f" {value}"
            also = " (or FSDP2/HSDP over --dp N, with or without --tp)" if getattr(args, "fsdp", None) else ""
            raise UnsupportedError(f"{flag}{shown}: trace runs one device{also} and cannot shard or offload a step; "
                                   f"estimate {flag}{shown} gives the per-rank memory")
    offload = tuple(x for x in (getattr(args, "offload", "") or "").split(",") if x)
    for what in offload:
        if what != "activations":  # torchtune's activation offloading runs in the trace (trace/offload.py)
            raise UnsupportedError(f"--offload {what}: trace offloads activations only (one device, no optimizer "
                                   f"or parameter offload); estimate --offload {what} gives the per-rank memory")
    return offload


#: What ``--pp`` traces beside it: one pipeline rank's schedule (trace/parallel_pp.py).
_PP_FLAGS = ("pp", "virtual_stages", "microbatches", "schedule", "layer_split")


def _pipeline_alone(args) -> bool:  # alone, with FSDP2 on each stage (--dp N --fsdp full) and/or TP (--tp N)
    return bool((getattr(args, "pp", None) or 1) > 1)


def pp_spec(args: argparse.Namespace):
    """The ParallelSpec ``trace --pp N [--dp N --fsdp full]`` asks (None without ``--pp``), checked in one line."""
    from trainmem.errors import SpecError
    if not _pipeline_alone(args):
        if getattr(args, "pp_rank", 0):
            raise SpecError("pp_rank", args.pp_rank, "needs --pp N, N >= 2")
        return None
    from trainmem.cliargs import parallel_from_args
    from trainmem.trace.parallel_pp import check_pp_flags
    par = parallel_from_args(args)
    check_pp_flags(par, args.pp_rank)
    return par


def tp_spec(args):
    """The ParallelSpec ``trace --tp N [--sp]`` asks (None without ``--tp``), checked in one line."""
    from trainmem.errors import SpecError
    if not getattr(args, "tp", None) or args.tp == 1:
        if getattr(args, "sp", False):
            raise SpecError("sp", True, "sequence parallelism needs --tp N, N >= 2")
        return None
    from trainmem.cliargs import parallel_from_args
    from trainmem.trace.parallel_tp import check_tp_flags
    par = parallel_from_args(args)
    check_tp_flags(par)
    return par


def fsdp_spec(args: argparse.Namespace):
    """The ParallelSpec ``--dp N --fsdp full|hybrid [--fsdp-group G] [--tp T [--sp]]`` asks (None
    without ``--fsdp``), checked in one line."""
    if not getattr(args, "fsdp", None):
        return None
    if getattr(args, "fsdp_group", None) is not None and args.fsdp != "hybrid":
        from trainmem.errors import SpecError
        raise SpecError("fsdp_group", args.fsdp_group, f"needs --fsdp hybrid, not --fsdp {args.fsdp}")
    from trainmem.cliargs import parallel_from_args
    from trainmem.specs.parallel import ParallelSpec
    from trainmem.trace.parallel_fsdp import check_fsdp_flags

    par = parallel_from_args(args) or ParallelSpec(fsdp=args.fsdp)
    check_fsdp_flags(par)
    return par


def run(args: argparse.Namespace) -> int:
    from trainmem.errors import SpecError
    from trainmem.specs import ImplSpec, StepSpec
    from trainmem.specs.loaders import load_config_dict
    from trainmem.trace import trace_step

    from trainmem.specs.step import default_seq
    from trainmem.specs.loaders import SUPPORTED_MODEL_TYPES, spec_from_hf_config
    from trainmem.cliargs import finetune_from_args
    from trainmem.trace.finetune import check_finetune

    offload = refuse_parallel(args)
    parallel = pp_spec(args) or fsdp_spec(args) or tp_spec(args)
    finetune = finetune_from_args(args)
    check_finetune(finetune, recompute=args.recompute)
    if finetune is not None and args.profile == "reference":
        raise SpecError("profile", "reference", "fine-tuning is traced on Hugging Face models (peft); use --profile hf")

    if args.profile == "reference":
        from trainmem.specs.loaders import load_model
        config = spec = load_model(args.model)  # a ModelSpec: trace trainmem's reference model
    else:
        config = load_config_dict(args.model)
        if args.num_labels is not None:
            if args.head not in ("seq-cls", "token-cls"):
                raise SpecError("num_labels", args.num_labels, "needs --head seq-cls or token-cls")
            config = {**config, "num_labels": args.num_labels}
        # the estimator's families are validated before torch is imported; any other type is left
        # to transformers (build_hf_model refuses auto_map and checks sizes)
        spec = (spec_from_hf_config(config, name=args.model) if config["model_type"] in SUPPORTED_MODEL_TYPES
                else None)
    max_positions = spec.max_positions if spec else None
    if args.seq is None:  # as the estimator: 4096, or the model's learned positions if fewer
        args.seq = default_seq(max_positions)
    if max_positions and args.seq > max_positions:
        raise SpecError("seq", args.seq, f"exceeds the {args.model} model's learned positions "
                                         f"(max_positions={max_positions})")
    step = StepSpec(batch=args.batch, seq=args.seq, grad_accum=args.grad_accum, precision=args.precision,
                    optimizer=args.optimizer, loss=args.loss)
    from trainmem.cliargs import recompute_every_from_args, recompute_from_from_args, resolve_attention
    every = recompute_every_from_args(args)
    resolve_attention(args, spec.family if spec else config.get("model_type", ""))
    impl = ImplSpec(profile=args.profile, attention=args.attention, recompute=args.recompute,
                    recompute_every=every, **recompute_from_from_args(args), device=args.device,
                    routing=args.routing,
                    optimizer_impl=args.optimizer_impl, optimizer_in_backward=args.optimizer_in_backward,
                    compile=args.compile, compile_scope=args.compile_scope, float8=args.float8,
                    float8_all_gather=args.float8_all_gather)
    from trainmem.fitargs import check_figure_args, gpu_from_args
    check_figure_args(args, reserved_known=True)  # bad --gpu/--memory-figure before the trace runs
    gpu_from_args(args)
    show = args.progress == "always" or (args.progress == "auto" and sys.stderr.isatty())
    result = trace_step(config, step, impl, real=args.real, progress=_bar if show else None,
                        head=args.head, experts=args.experts, finetune=finetune, offload=offload,
                        parallel=parallel, pp_rank=getattr(args, "pp_rank", 0))
    from trainmem.report.output import say_wrote
    if args.snapshot:
        from trainmem.trace.snapshot import write_snapshot
        say_wrote(write_snapshot(result, args.snapshot, expandable_segments=args.expandable_segments))
    if args.plot:
        from trainmem.report.plots import check_plot_path, save_plot
        check_plot_path(args.plot)
        say_wrote(save_plot(result, args.plot))
    if args.html:
        from trainmem.report.trace_page import write_html
        say_wrote(write_html(result, args.html, title=f"trainmem trace: {args.model}"))
    fit, fit_text = trace_fit(args, result)
    if args.json:
        from trainmem.schemas import set_inputs
        out = set_inputs(result.to_dict(), model=spec if spec is not None else args.model, gpu=gpu_from_args(args))
        out.update(fit)
        print(json.dumps(out))
    else:
        from trainmem.report.trace_text import render_trace
        print(render_trace(result))
        if "moe" in result.meta:
            print(routing_line(result.meta["moe"]))
        if "compile" in result.meta:
            print(compile_line(result.meta["compile"]))
        if "fsdp" in result.meta:
            from trainmem.trace.parallel_fsdp import fsdp_line
            print(fsdp_line(result.meta["fsdp"]))
        if "tp" in result.meta:
            from trainmem.trace.parallel_tp import tp_line
            print(tp_line(result.meta["tp"]))
        if "mesh" in result.meta:
            from trainmem.trace.parallel_2d import mesh_line
            print(mesh_line(result.meta["mesh"]))
        if "pp" in result.meta:
            from trainmem.trace.parallel_pp import pp_line
            print(pp_line(result.meta["pp"]))
        if fit_text:
            print(fit_text)
    return 0
