"""How long ``estimate --profile traced`` takes: the first (cold) estimate, which traces and fits,
and a cached one, beside the hf profile's estimate as the anchor.

Presets: llama-3-70b (a 70B-shaped dense model) at B1 and B2 and mixtral-8x7b (MoE, grouped_mm
experts, --routing balanced) at B1; S4096, bf16, sdpa, --device cpu. Each preset runs in fresh processes with
an empty cache folder:

  - cold: the first ``estimate()`` in a process whose torch and transformers are imported (the
    import time is listed apart): meta builds, seven (B >= 2) or four (B = 1) fake-tensor forwards
    of the cut model, the fits, the cache write;
  - cached, new process: the first ``estimate()`` in a second process, the template read from disk
    (with that process's one-time costs: importing trainmem's traced modules, reading versions);
  - cached, from disk: the same again in that process with the in-memory copy dropped;
  - cached, in memory: a later ``estimate()`` at another S of the same regime;
  - hf: ``estimate()`` with ``--profile hf`` (after a first call, which imports rule modules).
The last three are the fastest of 7 calls: the machine is shared, and the minimum is the call's cost.

Writes bench/results/traced_profile.md.

    PYTHONPATH=src python bench/traced_profile.py [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "bench" / "results" / "traced_profile.md"
CASES = (("llama-3-70b", 1), ("mixtral-8x7b", 1), ("llama-3-70b", 2))  # (preset, B); B >= 2 fits 7 points
S = 4096
REPEATS = 7


def _best(call, repeats: int = REPEATS) -> float:
    """The fastest of ``repeats`` calls (the machine is shared: the minimum is the call's own cost)."""
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        call()
        times.append(time.perf_counter() - t)
    return min(times)


def _child(preset: str, B: int) -> dict:
    t0 = time.perf_counter()
    import torch  # noqa: F401
    import transformers  # noqa: F401

    from trainmem.estimate import estimate, traced
    from trainmem.specs import ImplSpec, StepSpec
    from trainmem.specs.loaders import load_model
    imported, imported_cpu = time.perf_counter() - t0, time.process_time()  # CPU: since the process started
    from trainmem.estimate.traced.imports import import_transformers_models
    t, cpu = time.perf_counter(), time.process_time()
    import_transformers_models()  # what the cold estimate imports first (transformers' model code)
    models_s, models_cpu = time.perf_counter() - t, time.process_time() - cpu
    model = load_model(preset)
    step = StepSpec(batch=B, seq=S, precision="bf16")
    impl = ImplSpec(profile="traced", device="cpu", attention="sdpa", routing="balanced")
    t, cpu = time.perf_counter(), time.process_time()
    e = estimate(model, step, impl)
    first, first_cpu = time.perf_counter() - t, time.process_time() - cpu
    disk = _best(lambda: (traced._MEMO.clear(), estimate(model, step, impl)))
    memo = _best(lambda: estimate(model, StepSpec(batch=B, seq=S // 2, precision="bf16"), impl))
    hf_impl = ImplSpec(profile="hf", device="cpu", attention="sdpa", routing="balanced")
    h = estimate(model, step, hf_impl)
    hf = _best(lambda: estimate(model, step, hf_impl))
    tpl = next(iter(traced._MEMO.values()))
    return {"import_s": imported, "import_cpu_s": imported_cpu, "models_s": models_s, "models_cpu_s": models_cpu, "first_s": first, "first_cpu_s": first_cpu, "disk_s": disk, "memo_s": memo, "hf_s": hf,
            "traced_activation": e.totals_bytes["activation"], "hf_activation": h.totals_bytes["activation"],
            "traced_peak": e.peak_bytes, "hf_peak": h.peak_bytes, "traced_layers": tpl.traced_layers,
            "kinds": len(tpl.kinds), "points": len(tpl.points)}


def _run(preset: str, B: int, cache: str) -> dict:
    env = {**os.environ, "TRAINMEM_CACHE": cache, "PYTHONPATH": str(ROOT / "src")}
    out = subprocess.run([sys.executable, __file__, "--child", preset, "--batch", str(B)], env=env,
                         capture_output=True, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--batch", type=int, default=1, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(_child(args.child, args.batch)))
        return
    rows = []
    for preset, B in CASES:
        with tempfile.TemporaryDirectory() as cache:
            cold, warm = _run(preset, B, cache), _run(preset, B, cache)
        rows.append((f"{preset}, B{B}", cold, warm))
    import torch
    lines = [
        "# `estimate --profile traced`: cold and cached, beside `--profile hf`",
        "",
        f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs "
        f"(load average {os.getloadavg()[0]:.1f} at the end), torch {torch.__version__}",
        f"S{S}, bf16, sdpa, --device cpu, AdamW; one fresh process per column group, empty cache first",
        "",
        "| preset | start + imports (torch, transformers): wall / CPU | transformers' model code: wall / CPU | "
        "cold estimate (trace + fit): wall / CPU | cached, new process | "
        "cached, from disk | cached, in memory | hf estimate | blocks traced / kinds / points | "
        "activations traced vs hf | peak traced vs hf |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for preset, cold, warm in rows:
        d_act = cold["traced_activation"] - cold["hf_activation"]
        d_peak = cold["traced_peak"] - cold["hf_peak"]
        lines.append(
            f"| {preset} | {cold['import_s']:.1f} s / {cold['import_cpu_s']:.1f} s | {cold['models_s']:.1f} s / {cold['models_cpu_s']:.1f} s | "
            f"{cold['first_s']:.1f} s / {cold['first_cpu_s']:.1f} s | {warm['first_s'] * 1e3:.1f} ms | "
            f"{warm['disk_s'] * 1e3:.1f} ms | {warm['memo_s'] * 1e3:.1f} ms | {cold['hf_s'] * 1e3:.1f} ms | {cold['traced_layers']} / {cold['kinds']} / "
            f"{cold['points']} | {cold['traced_activation']:,} B ({d_act:+,}) | {cold['traced_peak']:,} B ({d_peak:+,}) |")
    lines += [
        "",
        "Goals (issue 14): cold under 10 s, cached under 5 ms. The machine may be shared (the load average above,",
        "on 2 CPUs): under load, wall times exceed CPU times, and the CPU time is the process's own.",
        "A cold estimate in a fresh process is the three CPU columns together: torch and transformers, then",
        "transformers' model code (modeling_utils and its quantizers, imported once; torchao left out, 0.8 s:",
        "src/trainmem/estimate/traced/imports.py), then the trace itself (meta builds, the fake-tensor forwards,",
        "the fits); the imports are most of it. The hf estimate is the anchor: same step, hand-written rules;",
        "traced and hf agree to the byte on activations and peak (the B = 1 labels: (B, S+1) int64 in both).",
    ]
    text = "\n".join(lines) + "\n"
    print(text)
    args.out.write_text(text)


if __name__ == "__main__":
    main()
