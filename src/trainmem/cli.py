"""Command line: argument parsing and dispatch only. Every command calls the public API and a
renderer. Errors the user can fix print one line ``Type: message`` and exit 2."""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys

from trainmem.errors import TrainmemError

__all__ = ["main", "build_parser"]

#: Commands implemented in their own modules: ``add_parser(subparsers)`` and ``run(args) -> int``.
PLUGGED = (
    "trainmem.trace.cli",      # trace, compare
    "trainmem.measure.cli",    # profile, sweep
    "trainmem.plan.cli",       # plan, advise, explain
    "trainmem.serve.cli",      # serve
)


#: the input-file flags only ``estimate`` reads (trainmem/inputs)
_FILE_FLAGS = ("--config", "--deepspeed", "--megatron-args", "--torchtitan", "--torchtune", "--hf-args")


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, exit 2 (argparse prints usage too)
        if message.startswith("unrecognized arguments") and any(
                w.split("=")[0] in _FILE_FLAGS for w in message.split()):
            message += " (input files are read by estimate only: give this command the settings as flags)"
        sys.stderr.write(f"{self.prog}: error: {message}\n")
        raise SystemExit(2)


def build_parser() -> argparse.ArgumentParser:
    from trainmem.cliargs import (add_compile_arg, add_finetune_args, add_float8_args, add_framework_arg, add_head_args,
                                  add_inference_args, add_model_step_args,
                                  add_optimizer_args, add_parallel_args, add_routing_arg, positive_int)
    from trainmem.fitargs import add_fit_args
    from trainmem.inputs import add_input_args

    p = _Parser(prog="trainmem", description="How much accelerator memory a Transformer training step needs.")
    sub = p.add_subparsers(dest="command", parser_class=_Parser, metavar="COMMAND")
    est = sub.add_parser("estimate", help="analytic estimate: ledgers, per-tensor activations, peak")
    add_model_step_args(est)
    add_framework_arg(est)
    add_head_args(est)
    est.add_argument("--json", action="store_true", help="print one JSON object (schema trainmem.estimate/2)")
    est.add_argument("--detail", action="store_true", help="every phase's parts and every tensor outside blocks")
    est.add_argument("--mode", dest="step_mode", choices=("train", "inference"), default="train",
                     help="train (one optimizer step) or inference (weights, prefill, KV cache)")
    add_inference_args(est)
    add_parallel_args(est)
    est.add_argument("--tree", type=int, nargs="?", const=3, metavar="DEPTH", choices=(1, 2, 3),
                     help="ledger → block → tensor tree with formulas (DEPTH 1-3; --detail: unfolded)")
    est.add_argument("--summary", action="store_true", help="one-screen summary")
    _add_output_args(est)
    add_routing_arg(est)
    add_optimizer_args(est)
    add_compile_arg(est)
    add_float8_args(est)
    add_fit_args(est)
    add_finetune_args(est)  # before add_input_args: a torchtune file sets the fine-tuning too
    add_input_args(est)  # last: it marks the other options' defaults
    est.set_defaults(func=_estimate)
    cmp = sub.add_parser("compare", help="estimate and trace side by side: ratio per module and for the peak")
    add_model_step_args(cmp)
    cmp.add_argument("--real", action="store_true", help="trace on real CPU tensors (small configs)")
    cmp.add_argument("--json", action="store_true", help="print one JSON object (schema trainmem.compare/2)")
    cmp.add_argument("--detail", action="store_true", help="list modules that agree too")
    cmp.add_argument("--per-tensor", action="store_true",
                     help="also join activations tensor by tensor (by key) and list those that differ")
    _add_output_args(cmp)
    add_optimizer_args(cmp)
    add_fit_args(cmp)
    cmp.set_defaults(func=_compare, device=None)  # CPU kernels only: a typed --device cuda is refused
    snp = sub.add_parser("snapshot", help="summarize a CUDA memory snapshot pickle (read safely: no code runs)")
    snp.add_argument("file", help="a torch.cuda.memory._dump_snapshot() pickle or trainmem trace --snapshot")
    snp.add_argument("--top", type=positive_int("top"), default=10, help="largest allocations to list (default 10)")
    snp.add_argument("--json", action="store_true", help="print one JSON object (schema trainmem.snapshot/2)")
    snp.set_defaults(func=_snapshot)
    pre = sub.add_parser("presets", help="list bundled model presets: engine, parameters (total, active per token)")
    pre.add_argument("--count", action="store_true",
                     help="also count presets the estimator does not map, from transformers' model on the meta "
                          "device (needs torch and transformers; seconds)")
    pre.add_argument("--sources", action="store_true",
                     help="also print where each preset's config.json was read from (its _source)")
    pre.set_defaults(func=_presets)
    for name in PLUGGED:
        try:
            mod = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if not (name == exc.name or name.startswith(f"{exc.name}.")):  # a real missing dependency
                raise
            continue
        mod.add_parser(sub)
    return p


def _add_output_args(p) -> None:
    p.add_argument("--html", metavar="FILE", help="write a self-contained HTML report")
    p.add_argument("--plot", metavar="FILE", help="write a figure (.png or .svg; needs matplotlib)")


def _estimate(args) -> int:
    from trainmem.cliargs import finetune_from_args, parallel_from_args, serving_from_args, specs_from_args
    from trainmem.estimate import estimate
    from trainmem.inputs import apply_inputs
    from trainmem.report.output import write_outputs

    files = apply_inputs(args)
    model, step, impl = specs_from_args(args)
    serving = serving_from_args(args, step.seq)
    if args.step_mode != "inference":  # a file's compile the compiled rules refuse: eager, with a note
        from trainmem.inputs.compile_keys import compile_from_files
        impl = compile_from_files(files, model, step, impl, parallel_from_args(args), finetune_from_args(args))
    if args.step_mode == "inference":
        from trainmem.estimate.inference import inference_estimate
        from trainmem.fitargs import gpu_from_args
        result = inference_estimate(model, step, impl, parallel_from_args(args), gpu=gpu_from_args(args), **serving)
    else:
        result = estimate(model, step, impl, parallel_from_args(args), finetune=finetune_from_args(args))
    scaling = None
    if getattr(args, "plot", None) and args.step_mode != "inference":  # the plot's memory-against-seq/batch panels
        from trainmem.estimate.scaling import scaling_sweeps
        from trainmem.report.plots import check_plot_path
        from trainmem.report.progress import Progress
        check_plot_path(args.plot)
        with Progress("scaling") as bar:
            scaling = scaling_sweeps(result, bar)
    write_outputs(result, args, title=f"trainmem estimate: {model.name}", scaling=scaling)
    from trainmem.fitargs import estimate_fit, gpu_from_args
    fit, fit_text = estimate_fit(args, result)
    if args.json:
        from trainmem.schemas import set_inputs
        out = set_inputs(result.to_dict(), gpu=gpu_from_args(args))
        if files:
            out["inputs"]["files"] = files
        if impl.compile and args.step_mode != "inference":
            out["compile"] = _saved_sets(result, model, step, impl, args)
        out.update(fit)
        print(json.dumps(out))
    elif args.tree:
        from trainmem.report.tree import render_tree
        print(render_tree(result, depth=args.tree, detail=args.detail))
    elif args.summary:
        from trainmem.report.tree import render_summary
        print(render_summary(result))
    else:
        from trainmem.report.text import render_estimate
        print(render_estimate(result, detail=args.detail))
        if impl.compile and args.step_mode != "inference":
            print(_eager_and_compiled(_saved_sets(result, model, step, impl, args)))
    if not args.json:
        if fit_text:
            print(fit_text)
        _print_file_notes(files)
    return 0


def _saved_sets(result, model, step, impl, args) -> dict:
    """Both saved sets of a compiled step (estimate/rules_compiled_report.py; JSON ``compile``)."""
    from trainmem.cliargs import finetune_from_args, parallel_from_args
    from trainmem.estimate.rules_compiled_report import saved_sets
    return saved_sets(result, model, step, impl, parallel_from_args(args), finetune_from_args(args))


def _eager_and_compiled(sets: dict) -> str:
    """Both saved sets, as trace prints them (issue 13: report what eager and what compile save)."""
    from trainmem.report.units import fmt_bytes
    return (f"saved for backward: eager {fmt_bytes(sets['saved_eager_bytes'])}, compiled "
            f"{fmt_bytes(sets['saved_compiled_bytes'])} (the eager set: the same estimate without --compile)")


def _print_file_notes(files: dict) -> None:
    """What each input file's reader approximated or left out (the JSON carries it in inputs.files)."""
    from trainmem.inputs import file_notes

    for path, notes in file_notes(files):
        print(f"\nfrom {path}:")
        for note in notes:
            print(f"  - {note}")


def _compare(args) -> int:
    from trainmem.cliargs import specs_from_args
    from trainmem.compare import compare
    from trainmem.errors import SpecError
    from trainmem.estimate import estimate
    from trainmem.specs.loaders import load_config_dict
    from trainmem.trace import trace_step

    if args.device == "cuda":  # typed (the default here is None): the trace cannot run CUDA kernels
        raise SpecError("device", "cuda", "compare traces CPU kernels and estimates the same kernels; for CUDA "
                                          "kernels run `estimate --device cuda`, or `profile` on a GPU")
    args.device = "cpu"  # the trace runs CPU kernels: compare like with like
    model, step, impl = specs_from_args(args)
    target = model if impl.profile == "reference" else load_config_dict(args.model)
    from trainmem.fitargs import check_figure_args, estimate_fit, gpu_from_args
    from trainmem.trace.cli import trace_fit
    # bad --gpu/--memory-figure before the trace runs; reserved is modelled by both sides (the estimate's
    # allocation order and the trace's allocations replayed through the caching-allocator model)
    check_figure_args(args, reserved_known=True)
    gpu_from_args(args)
    est, traced = estimate(model, step, impl), trace_step(target, step, impl, real=args.real)
    result = compare(est, traced)
    (efit, etext), (tfit, ttext) = estimate_fit(args, est, label="estimate: "), trace_fit(args, traced, label="trace:    ")
    from trainmem.report.output import write_outputs
    write_outputs(result, args, title=f"trainmem compare: {args.model}")
    if args.json:
        from trainmem.schemas import set_inputs
        out = set_inputs(result.to_dict(), gpu=gpu_from_args(args))
        print(json.dumps({**out, **({"estimate": efit, "trace": tfit} if efit or tfit else {})}))
    else:
        from trainmem.report.text import render_comparison
        print(f"precision: {step.precision_description}")
        print(render_comparison(result, detail=args.detail))
        if args.per_tensor:
            from trainmem.report.text import render_tensors
            print("\n".join(["", *render_tensors(result, detail=args.detail)]))
        print("\n".join(t for t in (etext, ttext) if t))
    return 0


def _snapshot(args) -> int:
    from trainmem.report.snapshot_text import render_snapshot
    from trainmem.trace.snapshot_load import load_snapshot, summarize_snapshot

    summary = summarize_snapshot(load_snapshot(args.file), top=args.top)
    if args.json:
        out = summary.to_dict()
        out["inputs"]["file"] = str(args.file)
        print(json.dumps(out))
    else:
        print(render_snapshot(args.file, summary))
    return 0


def _presets(args) -> int:
    from trainmem.report.presets_text import render_presets
    from trainmem.specs.presets import preset_infos

    print(render_presets(preset_infos(count_meta=args.count), sources=args.sources))
    return 0


def _forget_unhandled_interrupt() -> None:
    """Let ``python -m trainmem.cli`` exit with 130, not by SIGINT, after a handled Ctrl-C.

    CPython marks a KeyboardInterrupt that leaves code run from a string (builtin exec/eval ->
    PyRun_StringFlags -> Python/pythonrun.c, run_eval_code_obj) as unhandled, even when a caller
    catches it later; under ``-m``, Py_RunMain (Modules/main.c) then ends the process by raising
    SIGINT again (exit_sigint) whatever main() returned. dataclasses and namedtuple build their
    methods with exec of a string, hundreds of times while torch imports, so a Ctrl-C during the
    imports ended as exit -2 after the "interrupted" line. Every string exec clears the mark first.
    """
    exec("pass", {})  # noqa: S102 - a constant string: resets the mark described above


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    from trainmem.dependency_logs import silence_dependency_noise
    loud_again = silence_dependency_noise()  # torchao's CPU-build warnings (dependency_logs.py)
    sigint_before = None  # SIGINT's handler, kept while a handled Ctrl-C cleans up
    try:  # Ctrl-C while the parser imports the command modules (torch, transformers) exits cleanly too
        parser = build_parser()
        if not argv or argv[0].startswith("-") and argv[0] not in ("-h", "--help"):
            argv = ["estimate", *argv]
        args = parser.parse_args(argv)
        if not getattr(args, "func", None):
            parser.print_help()
            return 2
        if getattr(args, "json", False) is True:  # (estimate marks defaults given on the command line)
            return args.func(args)
        from trainmem.report.wrap import WrappingWriter
        out, sys.stdout = sys.stdout, WrappingWriter(sys.stdout)  # text output fits 120 columns
        try:
            return args.func(args)
        finally:
            sys.stdout.flush()
            sys.stdout = out
    except TrainmemError as exc:
        sys.stderr.write(f"{type(exc).__name__}: {exc}\n")
        return 2
    except KeyboardInterrupt:
        import signal
        sigint_before = signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C must not cut the cleanup
        sys.stderr.write("interrupted\n")
        _forget_unhandled_interrupt()
        return 130
    except BrokenPipeError:
        return 0
    except Exception as exc:  # a bug, not bad input: one line unless asked for the traceback
        if os.environ.get("TRAINMEM_DEBUG"):
            raise
        sys.stderr.write(f"trainmem: internal error: {type(exc).__name__}: {exc} "
                         "(set TRAINMEM_DEBUG=1 for the traceback, and please report it)\n")
        return 1
    finally:
        loud_again()
        if sigint_before is not None:  # an in-process caller gets its own Ctrl-C handling back
            import signal
            signal.signal(signal.SIGINT, sigint_before)


def console() -> int:
    """The ``trainmem`` command: :func:`main`, and after a handled Ctrl-C, SIGINT stays ignored
    while the interpreter exits, so a late Ctrl-C cannot cut its cleanup short."""
    code = main()
    if code == 130:
        import signal
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    return code


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(console())
