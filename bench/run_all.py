"""Run every benchmark and index their tables in bench/results/README.md.

    python bench/run_all.py            # everything (a few minutes on 2 CPU cores)
    python bench/run_all.py --quick    # a fast subset: smaller trace-vs-MemTracker step, quick grid

Each benchmark runs in its own process (so one's memory and imports do not bias the next) and
writes its own table with the machine's description; this script records what ran, its wall
time and exit status. bench/gpu_validate.py runs only where CUDA is present.
"""

from __future__ import annotations

import argparse
import platform
import subprocess
import sys
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
RESULTS = BENCH / "results"


def _cuda() -> bool:
    try:
        import torch
        return torch.cuda.is_available()
    except ImportError:
        return False


def plan(quick: bool) -> list[tuple[str, list[str], str]]:
    """(name, argv, results file) in the order they run."""
    runs = [
        ("estimator latency", ["estimate_latency.py"], "estimate_latency.md"),
        ("planner search time", ["plan_search.py"], "plan_search.md"),
        ("tracer vs MemTracker", ["trace_vs_memtracker.py", *(["--seq", "1024"] if quick else [])],
         "trace_vs_memtracker.md"),
        ("trace_model, your own 7B-shaped module", ["trace_model.py", *(["--seq", "1024"] if quick else [])],
         "trace_model.md"),
        ("accuracy grid", ["accuracy_grid.py", *(["--quick"] if quick else [])], "accuracy_grid.md"),
        ("published GPU figures", ["published/run.py"], "published.md"),
    ]
    if _cuda():
        runs.append(("GPU validation", ["gpu_validate.py", *(["--limit", "4"] if quick else [])], "gpu_validate.md"))
    return runs


def machine() -> str:
    import os

    out = f"{platform.platform()}, Python {sys.version.split()[0]}, {os.cpu_count()} CPU cores"
    try:
        import torch
        gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
        out += f", torch {torch.__version__}, {gpu}"
    except ImportError:
        out += ", no torch"
    return out


def kept_sections(readme: Path) -> list[str]:
    """The hand-written sections of the old index (from its first ``## `` heading on: how to run the GPU
    validation on a lent GPU), which a rerun keeps below the regenerated table."""
    old = readme.read_text().splitlines() if readme.exists() else []
    first = next((i for i, line in enumerate(old) if line.startswith("## ")), len(old))
    return [""] + old[first:] if first < len(old) else []


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="a fast subset")
    args = ap.parse_args(argv)
    rows = []
    for name, cmd, result in plan(args.quick):
        print(f"== {name}: python bench/{' '.join(cmd)}", flush=True)
        t0 = time.perf_counter()
        rc = subprocess.call([sys.executable, str(BENCH / cmd[0]), *cmd[1:]], cwd=BENCH.parent)
        rows.append((name, " ".join(cmd), rc, time.perf_counter() - t0, result))
    lines = [
        "# Benchmark results",
        "",
        f"Machine: {machine()}",
        f"Command: `python bench/run_all.py{' --quick' if args.quick else ''}` "
        f"({time.strftime('%Y-%m-%d %H:%M %Z')})",
        "",
        "| benchmark | command | exit | wall s | table |",
        "|---|---|---:|---:|---|",
        *(f"| {n} | `python bench/{c}` | {rc} | {s:.1f} | [{r}]({r}) |" for n, c, rc, s, r in rows),
        "",
        "Each table states its own machine and settings. GPU validation (bench/gpu_validate.py) runs "
        "only where CUDA is present; the accuracy grid then adds an estimate ÷ measured column.",
    ]
    (RESULTS / "README.md").write_text("\n".join(lines + kept_sections(RESULTS / "README.md")) + "\n")
    print("\n".join(lines))
    return max(r[2] for r in rows) if rows else 0


if __name__ == "__main__":
    raise SystemExit(main())
