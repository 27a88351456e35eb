"""Side by side: PyTorch's MemTracker and trainmem's tracer on the same training step.

Default: Llama-2-7B shape (32 layers), batch 1, seq 4096, bf16, AdamW(foreach=True), SDPA, on
FakeTensorMode CPU tensors. Both trace the second of two steps; the table gives the traced step
alone and, for trainmem, the whole ``trace_step`` call (model build + untraced first step +
traced step + analysis). ``--rss`` also traces a Llama-3.1-405B-shaped step in a fresh process
and reports its peak resident memory.

    PYTHONPATH=src python bench/trace_vs_memtracker.py [--model llama-2-7b] [--seq 4096] [--rss]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import time
from pathlib import Path

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from trainmem.models.hf import build_hf_model
from trainmem.specs import ImplSpec, StepSpec
from trainmem.trace import trace, trace_step

MiB = 2**20
OUT = Path(__file__).parent / "results" / "trace_vs_memtracker.md"


def load(name: str) -> dict:
    try:
        from trainmem.specs.loaders import load_config_dict
        return load_config_dict(name)
    except ImportError:
        path = Path(__file__).parents[1] / "src/trainmem/data/models" / f"{name}.json"
        return json.loads(path.read_text())


def build(cfg: dict):
    torch.set_default_dtype(torch.bfloat16)
    try:
        model = build_hf_model(cfg, attention="sdpa")
    finally:
        torch.set_default_dtype(torch.float32)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
    return model, opt


def one_step(model, opt, ids) -> None:
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def run_memtracker(cfg: dict, batch: int, seq: int) -> tuple[float, int]:
    from torch.distributed._tools.mem_tracker import MemTracker
    with FakeTensorMode():
        model, opt = build(cfg)
        ids = torch.randint(0, cfg["vocab_size"], (batch, seq))
        one_step(model, opt, ids)
        mt = MemTracker()
        mt.track_external(model, opt, ids)
        t0 = time.perf_counter()
        with mt:
            one_step(model, opt, ids)
        dt = time.perf_counter() - t0
    return dt, max(d["Total"] for d in mt.get_tracker_snapshot("peak").values())


def run_tracer_step_only(cfg: dict, batch: int, seq: int) -> tuple[float, int, int]:
    with FakeTensorMode():
        model, opt = build(cfg)
        ids = torch.randint(0, cfg["vocab_size"], (batch, seq))
        one_step(model, opt, ids)
        t0 = time.perf_counter()
        with trace(model, opt, inputs=[ids]) as t:
            one_step(model, opt, ids)
        dt = time.perf_counter() - t0  # includes the analysis and the allocator replay
    return dt, t.result.peak_logical_bytes, t.result.peak_bytes


def run_trace_step(cfg: dict, batch: int, seq: int):
    t0 = time.perf_counter()
    r = trace_step(cfg, StepSpec(batch=batch, seq=seq, precision="bf16", optimizer="adamw"), ImplSpec(attention="sdpa"))
    return time.perf_counter() - t0, r


def rss_child(name: str, batch: int, seq: int) -> None:
    cfg = load(name)
    t0 = time.perf_counter()
    r = trace_step(cfg, StepSpec(batch=batch, seq=seq, precision="bf16"), ImplSpec(attention="sdpa"))
    dt = time.perf_counter() - t0
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB
    print(json.dumps({"seconds": dt, "max_rss_bytes": rss, "peak_bytes": r.peak_bytes,
                      "num_allocations": r.num_allocations, "layers": cfg["num_hidden_layers"]}))


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return (f"{cpu}, {os.cpu_count()} cores, {mem:.0f} GiB RAM, Python {platform.python_version()}, "
            f"torch {torch.__version__}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama-2-7b")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--rss", action="store_true", help="also trace a 405B-shaped step in a child process")
    ap.add_argument("--rss-model", default="llama-3.1-405b")
    ap.add_argument("--rss-child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args()
    if args.rss_child:
        rss_child(args.rss_model, args.batch, args.seq)
        return 0

    cfg = load(args.model)
    mt_s, mt_peak = run_memtracker(cfg, args.batch, args.seq)
    tr_s, tr_logical, tr_peak = run_tracer_step_only(cfg, args.batch, args.seq)
    full_s, r = run_trace_step(cfg, args.batch, args.seq)
    rows = [
        ("MemTracker, traced step", mt_s, mt_peak, "-"),
        ("trainmem trace(), traced step + analysis", tr_s, tr_logical, f"{tr_s / mt_s:.3f}"),
        ("trainmem trace_step() (build + 2 steps + analysis)", full_s, r.peak_logical_bytes, f"{full_s / mt_s:.3f}"),
    ]
    lines = [
        "# trainmem tracer vs torch MemTracker",
        "",
        f"Step: {args.model} shape ({cfg['num_hidden_layers']} layers), batch {args.batch}, seq {args.seq}, "
        "bf16 parameters, AdamW(foreach=True), SDPA, FakeTensorMode on CPU; second of two steps.",
        f"Machine: {machine()}.",
        f"Command: `PYTHONPATH=src python bench/trace_vs_memtracker.py {' '.join(sys.argv[1:])}`".rstrip(),
        "",
        "| run | seconds | peak (logical) MiB | time / MemTracker |",
        "|---|---:|---:|---:|",
        *[f"| {n} | {s:.2f} | {p / MiB:.2f} | {q} |" for n, s, p, q in rows],
        "",
        f"Peak difference (trainmem - MemTracker): {(tr_logical - mt_peak) / mt_peak:+.4%}. "
        f"trainmem 512-byte-rounded peak: {tr_peak / MiB:.2f} MiB; predicted reserved (caching allocator "
        f"model): {r.peak_reserved_bytes / MiB:.2f} MiB, with expandable_segments "
        f"{r.peak_reserved_expandable_bytes / MiB:.2f} MiB; peak at {r.peak_phase} / {r.peak_module or '<root>'} / "
        f"{r.peak_op}; {r.num_allocations} allocations.",
    ]
    if args.rss:
        child = subprocess.run([sys.executable, __file__, "--rss-child", "--rss-model", args.rss_model,
                                "--batch", str(args.batch), "--seq", str(args.seq)],
                               capture_output=True, text=True, check=True)
        info = json.loads(child.stdout.strip().splitlines()[-1])
        lines += [
            "",
            f"## Resident memory: {args.rss_model} shape ({info['layers']} layers), batch {args.batch}, "
            f"seq {args.seq}, bf16, AdamW",
            "",
            f"`trace_step` in a fresh process: {info['seconds']:.1f} s, peak RSS "
            f"{info['max_rss_bytes'] / 2**30:.2f} GiB (whole process, torch and transformers included); "
            f"traced peak {info['peak_bytes'] / 2**30:.1f} GiB over {info['num_allocations']} allocations.",
        ]
    text = "\n".join(lines) + "\n"
    print(text)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
