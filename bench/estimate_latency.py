"""Estimator latency per preset: median of repeated estimates (compute only, no rendering).

Target (issue #2): a single estimate of the largest preset under 5 ms.
Writes bench/results/estimate_latency.md with the machine's description.
"""

from __future__ import annotations

import platform
import statistics
import sys
import time
from pathlib import Path

from trainmem.estimate import estimate
from trainmem.specs import ImplSpec, StepSpec
from trainmem.specs.loaders import load_model
from trainmem.specs.presets import estimated_presets


def median_ms(fn, repeat: int = 21) -> float:
    fn()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def main() -> int:
    impl = ImplSpec()
    rows = []
    for name in estimated_presets():  # the hf rules; --profile traced: bench/traced_profile.py
        model = load_model(name)
        step = StepSpec(batch=1, seq=min(4096, model.max_positions or 4096), precision="bf16")
        rows.append((name, model.num_layers, median_ms(lambda: estimate(model, step, impl)),
                     median_ms(lambda: estimate(model, step, impl).inventory.items, repeat=7)))
    rows.sort(key=lambda r: -r[1])
    lines = [
        "# Estimator latency (median of 21, compute only)",
        "",
        f"machine: {platform.machine()}, {platform.processor() or 'cpu'}, Python {platform.python_version()}, "
        f"{platform.system()} {platform.release()}",
        "step: B=1 S=4096 (or the model's maximum) bf16 AdamW, profile hf, sdpa; target: under 5 ms for the "
        "largest preset (issue #2)",
        "",
        "Totals, phases and peak are computed from one block's template; the second column also",
        "expands every per-tensor item of every block (what --json prints).",
        "",
        "| preset | layers | estimate, median ms | + all items expanded, median ms |",
        "|---|---:|---:|---:|",
        *[f"| {n} | {layers} | {ms:.2f} | {full:.2f} |" for n, layers, ms, full in rows],
    ]
    text = "\n".join(lines) + "\n"
    print(text)
    out = Path(__file__).parent / "results" / "estimate_latency.md"
    out.parent.mkdir(exist_ok=True)
    out.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
