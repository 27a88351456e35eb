"""How long ``trace_model`` takes, and how much host memory, on a Llama-2-7B-shaped module of your own.

The module is ``TinyLM`` from ``tests/trace/test_trace_model.py`` (pre-norm blocks written with
plain torch: SDPA attention, SwiGLU MLP) at 32 blocks, d 4096, 32 heads, ffn 11008, vocab 32000;
B1, bf16, AdamW foreach (trace_model's default). One fresh process; wall time of the whole call
(build on fake tensors, warm-up step, recorded step, analysis) and the process's peak RSS.

Writes bench/results/trace_model.md.

    PYTHONPATH=src python bench/trace_model.py [--seq 4096] [--out FILE]
"""

from __future__ import annotations

import argparse
import platform
import resource
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "bench" / "results" / "trace_model.md"
sys.path.insert(0, str(ROOT / "tests" / "trace"))

from test_trace_model import TinyLM, lm_step  # noqa: E402

from trainmem.trace import trace_model  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args()
    start = time.perf_counter()
    r = trace_model(lambda: TinyLM(vocab=32000, d=4096, heads=32, ffn=11008, layers=32), lm_step,
                    batch_factory=lambda: torch.randint(0, 32000, (1, args.seq)), dtype="bfloat16")
    wall_s = time.perf_counter() - start
    rss_gib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    lines = [
        "# trace_model on a Llama-2-7B-shaped custom module",
        "",
        f"machine: {platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, torch {torch.__version__}",
        f"B1, S{args.seq}, bf16, AdamW foreach, fake tensors",
        "",
        "| wall time (whole call) | peak RSS (process) | traced peak | at |",
        "|---|---|---|---|",
        f"| {wall_s:.1f} s | {rss_gib:.2f} GiB | {r.peak_bytes / 2**30:,.2f} GiB | {r.peak_phase} / {r.peak_op} |",
    ]
    text = "\n".join(lines) + "\n"
    print(text)
    args.out.write_text(text)


if __name__ == "__main__":
    main()
