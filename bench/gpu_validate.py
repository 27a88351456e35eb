"""Estimate vs trace vs measurement on one GPU (under 8 minutes), or a tiny dry run on CPU.

    timeout -s TERM -k 20 560 python bench/gpu_validate.py   # CUDA: bench/results/gpu_validate.{md,json}
    python bench/gpu_validate.py --cpu              # tiny sizes on CPU (also --dry-run): checks the script works
    python bench/gpu_validate.py --only compile-block,op-eager   # rerun chosen rows, the others kept

Each row is one training step (Hugging Face Llama or trainmem's reference model, two layers of
Llama-2-7B's widths, batch 1, bf16 unless the row says otherwise) estimated
(``ImplSpec(device="cuda")``), traced on fake tensors, and measured with trainmem's own measure engine
(``trainmem.measure``: the allocator's allocated, active, reserved peaks after a warm-up step, and the
device figure: reserved + the CUDA context from ``torch.cuda.mem_get_info``), with the errors in percent
and tokens/s. Rows, most valuable first (``bench/gpu_validate_plan.py``; issue 13's mechanisms first):

1. torch.compile per block and whole model, recompute none and full (S 4096, fused AdamW): the measured
   step runs inductor's real code on CUDA; the dry run uses the trace's partitioning backend;
2. op-level selective checkpointing (``--recompute op``, torchtitan's policy), eager and per block;
3. the optimizer implementations at S 1024 (where the optimizer step is the peak): foreach, fused,
   for-loop, and stepped in backward (``--optimizer-in-backward``);
4. Float8 tensorwise compiled per block with recompute full (torchao; how Float8 is run in practice);
5. the older ladder: eager vs flash attention at S 1k-8k on both models, recompute full and AMP bf16 at
   4k, the low-bit optimizers (bitsandbytes, torchao; paged states are left out of the allocated peak,
   ``estimate_paged_bytes`` beside it) and eager Float8 (tensorwise, rowwise; bf16, amp-bf16).

A row whose library is missing, whose estimate or trace is refused, or whose step raises says so in
one line (``status``, ``notes``); an out-of-memory step is a row that says so. Rows still waiting when
``--budget-s`` is spent are listed as skipped. The JSON and Markdown are rewritten whole (temporary
file, then rename) after every row, so an interrupted run (timeout, SIGTERM, Ctrl-C) leaves every row
finished so far, the one in progress marked interrupted.
"""

from __future__ import annotations

import argparse
import json
import platform
import signal
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_validate_plan import Run, plan, select  # noqa: E402

from trainmem.atomic import write_text_atomic  # noqa: E402
from trainmem.report.units import fmt_bytes  # noqa: E402
from trainmem.specs.loaders import load_config_dict  # noqa: E402

#: the statuses of rows a run did not start
NOT_STARTED = ("skipped (time budget)", "not run (interrupted)")
TINY = dict(model_type="llama", hidden_size=64, intermediate_size=176, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=4, vocab_size=1000, max_position_embeddings=4096)


def model_config(cpu: bool) -> dict:
    if cpu:
        return dict(TINY)
    # rotary positions: 8k is as valid as 4k, but the estimator holds max_positions to the config
    return {**load_config_dict("llama-2-7b"), "num_hidden_layers": 2, "max_position_embeddings": 8192}


def _step_words(r: dict) -> str:
    """``hf flash bf16 S4096, compile block, recompute full, fused``: the row's settings in a few words."""
    words = [f"{r['model']} {r['attention']} {r['precision']} S{r['seq']}"]
    if r.get("compile_scope"):
        words.append(f"compile {r['compile_scope']}")
    if r.get("recompute", "none") != "none":
        words.append(f"recompute {r['recompute']}")
    if r.get("float8", "none") != "none":
        words.append(f"float8 {r['float8']}")
    if r.get("optimizer", "adamw") != "adamw":
        words.append(r["optimizer"])
    if r.get("optimizer_impl", "auto") != "auto":
        words.append(r["optimizer_impl"])
    if r.get("optimizer_in_backward"):
        words.append("in backward")
    return ", ".join(words)


def render(rows: list[dict], header: dict) -> str:
    def b(v):
        return "n/a" if v is None else fmt_bytes(v)

    def p(*vals):
        return " / ".join("–" if v is None else f"{v:+.1f}%" for v in vals)

    out = ["# Estimate vs trace vs measurement" + (" (CPU dry run)" if header["cpu"] else ""), "",
           f"- device: {header['device']}", f"- torch {header['torch']}, transformers {header['transformers']}, "
           f"python {header['python']}",
           f"- model: {header['model']}; batch 1; AdamW unless the row names another optimizer; errors are "
           "(predicted − measured) / measured",
           "- estimate and trace figures: allocated (trace: block-rounded; logical in the JSON), active = allocated, "
           "reserved (allocator model), device = reserved + the GPU preset's CUDA context "
           f"({header['gpu_preset']}); measured device = peak reserved + the context torch.cuda.mem_get_info shows",
           f"- wall time: {header['wall_s']:.0f} s of a {header['budget_s']:.0f} s budget"
           + ("" if header["finished"] else "; INTERRUPTED: the rows below are those finished"), ""]
    if header["cpu"]:
        out += ["CPU dry run: peaks are live-set bytes; active, reserved and device are n/a; compiled steps are "
                "measured with the trace's partitioning backend (no inductor code); only checks that the script "
                "works.", ""]
    out += ["| id | step | estimate | trace | allocated | active | reserved | device | est. err alloc / active / "
            "reserved / device | trace err alloc / reserved / device | tokens/s | status |",
            "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        g = r.get
        tps = "" if g("tokens_per_s") is None else f"{r['tokens_per_s']:,.0f}"
        paged = f" (+{b(r['estimate_paged_bytes'])} paged)" if g("estimate_paged_bytes") else ""
        status = r["status"] + "".join(f"; {n}" for n in g("notes", ()))
        out.append(f"| {r['id']} | {_step_words(r)} | {b(g('estimate_bytes'))}{paged} | {b(g('trace_bytes'))} | "
                   f"{b(g('allocated_bytes'))} | {b(g('active_bytes'))} | {b(g('reserved_bytes'))} | "
                   f"{b(g('device_bytes'))} | "
                   + p(g('estimate_error_pct'), g('estimate_active_error_pct'), g('estimate_reserved_error_pct'),
                       g('estimate_device_error_pct'))
                   + " | " + p(g('trace_error_pct'), g('trace_reserved_error_pct'), g('trace_device_error_pct'))
                   + f" | {tps} | {status.replace('|', '/')} |")
    return "\n".join(out) + "\n"


def _previous_rows(path: Path, only: str | None) -> list[dict]:
    """With ``--only``, the rows of the earlier run at ``path`` (its other rows are kept; none without
    ``--only`` or an earlier file)."""
    if not only or not path.is_file():
        return []
    try:
        return list(json.loads(path.read_text())["rows"])
    except (ValueError, KeyError, TypeError):
        return []


def _merged(previous: list[dict], rows: list[dict], order: list[str]) -> list[dict]:
    """The earlier rows with this run's in their place, in plan order; a row this run did not start
    (skipped by the budget, not run after an interruption) leaves the earlier one standing."""
    by_id = {r["id"]: r for r in previous}
    by_id.update({r["id"]: r for r in rows if r["status"] not in NOT_STARTED or r["id"] not in by_id})
    return [by_id[i] for i in order if i in by_id] + [r for i, r in by_id.items() if i not in order]


def _write(out: Path, stem: str, rows: list[dict], header: dict) -> str:
    write_text_atomic(out / f"{stem}.json", json.dumps({"header": header, "rows": rows}, indent=1) + "\n")
    text = render(rows, header)
    write_text_atomic(out / f"{stem}.md", text)
    return text


def _interrupt(signum, frame):  # SIGTERM (timeout) as Ctrl-C: the rows so far are written
    raise KeyboardInterrupt(f"signal {signum}")


def _parse(argv):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cpu", "--dry-run", dest="cpu", action="store_true", help="tiny sizes on CPU")
    ap.add_argument("--out-dir", default=str(ROOT / "bench" / "results"))
    ap.add_argument("--budget-s", type=float, default=450.0, help="stop starting rows after this many seconds")
    ap.add_argument("--limit", type=int, default=None, help="only the first N rows")
    ap.add_argument("--only", default=None, metavar="ID[,ID...]",
                    help="only these rows (ids as in the table); an earlier run's other rows are kept in the files")
    args = ap.parse_args(argv)
    if not args.budget_s > 0:
        raise ValueError(f"budget_s={args.budget_s}: must be a positive number of seconds")
    if args.limit is not None and args.limit < 1:
        raise ValueError(f"limit={args.limit}: must be at least 1")
    return args


def main(argv: list[str] | None = None) -> int:
    try:
        args = _parse(argv)
        runs: list[Run] = select(plan(args.cpu), args.only)[: args.limit]
    except ValueError as exc:
        sys.stderr.write(f"gpu_validate: {exc}\n")
        return 2
    import torch
    try:
        from transformers import __version__ as transformers_version
    except ImportError:  # the Hugging Face rows then fail one by one, each saying so
        transformers_version = "not installed"

    if not args.cpu and not torch.cuda.is_available():
        sys.stderr.write("gpu_validate: no CUDA device; run with --cpu for the dry run\n")
        return 2
    from gpu_validate_run import gpu_preset, run_one

    device = "cpu" if args.cpu else "cuda"
    config = model_config(args.cpu)
    header = {"cpu": args.cpu, "device": "cpu" if args.cpu else f"cuda ({torch.cuda.get_device_name()})",
              "torch": torch.__version__, "transformers": transformers_version,
              "python": platform.python_version(), "gpu_preset": gpu_preset(device).name,
              "model": "tiny Llama (H=64, 2 layers)" if args.cpu else "Llama-2-7B widths, 2 layers",
              "budget_s": args.budget_s, "only": args.only, "wall_s": 0.0, "finished": False}
    stem = "gpu_validate_cpu" if args.cpu else "gpu_validate"
    out = Path(args.out_dir)
    previous, order = _previous_rows(out / f"{stem}.json", args.only), [r.id for r in plan(args.cpu)]
    sigterm = signal.signal(signal.SIGTERM, _interrupt)
    t0 = time.perf_counter()
    rows: list[dict] = []
    try:
        for run in runs:
            if time.perf_counter() - t0 > args.budget_s:
                rows.append({"id": run.id, **run.settings(), "status": NOT_STARTED[0]})
                continue
            rows.append(run_one(run, config, device))
            print(f"{run.id:28} {time.perf_counter() - t0:6.0f} s  {rows[-1]['status']}", file=sys.stderr)
            header["wall_s"] = time.perf_counter() - t0
            _write(out, stem, _merged(previous, rows, order), header)
        header["finished"] = True
    except KeyboardInterrupt as exc:
        done = {r["id"] for r in rows}
        rows += [{"id": r.id, **r.settings(), "status": f"interrupted ({exc or 'Ctrl-C'})" if i == 0 else
                  NOT_STARTED[1]} for i, r in enumerate(r for r in runs if r.id not in done)]
    finally:
        signal.signal(signal.SIGTERM, sigterm)
    header["wall_s"] = time.perf_counter() - t0
    print(_write(out, stem, _merged(previous, rows, order), header))
    return 0 if header["finished"] else 130


if __name__ == "__main__":
    raise SystemExit(main())
