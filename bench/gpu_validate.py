"""Estimate vs trace vs measurement on one GPU (under 8 minutes), or a tiny dry run on CPU.

    python bench/gpu_validate.py            # CUDA: writes bench/results/gpu_validate.{md,json}
    python bench/gpu_validate.py --cpu      # tiny sizes on CPU (also --dry-run): checks the script works

Runs trainmem's reference model and a Hugging Face Llama, two layers each (Llama-2-7B widths),
over eager vs flash attention at sequence 1k, 2k, 4k and 8k (bf16, no recompute), then
recompute full and AMP bf16 at 4k, then the low-bit optimizers on the Hugging Face model at 4k
(flash, bf16: adamw8bit, paged-adamw8bit, torchao-adamw8bit/4bit; docs/optimizers.md), then torchao
Float8 training at 4k (bf16 and amp-bf16 x tensorwise and rowwise; docs/float8.md). For the paged
one the allocated peak must leave its paged states out (``estimate_paged_bytes`` beside it); torchao's
rows have no trace (the tracer refuses it). For each run: the estimate (``ImplSpec(device="cuda")``),
the trace (fake tensors), the measured allocated and reserved peaks (the allocator's own
statistics after a warm-up step), their errors in percent, tokens/s, and the memory in use
outside the caching allocator (CUDA context, cuBLAS/cuDNN workspaces). A run that runs out of
memory is a row that says so. Runs still waiting when ``--budget-s`` is spent are listed as
skipped. Outputs are written whole (temporary file, then rename).
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from trainmem.atomic import write_text_atomic  # noqa: E402
from trainmem.measure.compare import error_pct  # noqa: E402
from trainmem.report.units import fmt_bytes  # noqa: E402
from trainmem.specs import ImplSpec, StepSpec  # noqa: E402
from trainmem.specs.loaders import load_config_dict, spec_from_hf_config  # noqa: E402

GPU_SEQS = (1024, 2048, 4096, 8192)
GPU_OPTIMIZERS = ("adamw8bit", "paged-adamw8bit", "torchao-adamw8bit", "torchao-adamw4bit")
CPU_OPTIMIZERS = ("adamw8bit",)  # torchao's compiled step would build C++ kernels on CPU
CPU_SEQS = (64, 128)
TINY = dict(model_type="llama", hidden_size=64, intermediate_size=176, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=4, vocab_size=1000, max_position_embeddings=4096)


def plan(cpu: bool) -> list[dict]:
    """The runs: a sequence ladder per model and attention, then the recompute and precision toggles."""
    if cpu:
        config, seqs, toggle_seq = dict(TINY), CPU_SEQS, CPU_SEQS[-1]
    else:
        # rotary positions: 8k is as valid as 4k, but the estimator holds max_positions to the config
        config = {**load_config_dict("llama-2-7b"), "num_hidden_layers": 2, "max_position_embeddings": 8192}
        seqs, toggle_seq = GPU_SEQS, 4096
    runs = []
    for model in ("reference", "hf"):
        for attention in ("eager", "flash"):
            for seq in seqs:
                runs.append(dict(model=model, attention=attention, recompute="none", precision="bf16", seq=seq))
            runs.append(dict(model=model, attention=attention, recompute="full", precision="bf16", seq=toggle_seq))
            runs.append(dict(model=model, attention=attention, recompute="none", precision="amp-bf16", seq=toggle_seq))
    for optimizer in CPU_OPTIMIZERS if cpu else GPU_OPTIMIZERS:
        runs.append(dict(model="hf", attention="sdpa" if cpu else "flash", recompute="none", precision="bf16",
                         seq=toggle_seq, optimizer=optimizer))
    # Float8 (docs/float8.md): torchao's conversion on the Hugging Face model; on CPU bf16 only (CPU
    # autocast alone does not make Float8Linear cast its input, CUDA's does)
    for precision in ("bf16",) if cpu else ("bf16", "amp-bf16"):
        for recipe in ("tensorwise",) if cpu else ("tensorwise", "rowwise"):
            runs.append(dict(model="hf", attention="sdpa" if cpu else "flash", recompute="none",
                             precision=precision, seq=toggle_seq, float8=recipe))
    for r in runs:
        r["config"] = config
    return runs


def run_one(r: dict, device: str) -> dict:
    from trainmem.estimate import estimate
    from trainmem.measure.profiling import OutOfMemory, profile_model
    from trainmem.trace import trace_step

    spec = spec_from_hf_config(r["config"], name="llama-2-7b-2L" if r["config"]["vocab_size"] > 1000 else "tiny")
    step = StepSpec(batch=1, seq=r["seq"], precision=r["precision"], optimizer=r.get("optimizer", "adamw"))
    # the kernels modelled are the device's own (the brief's GPU rows: device="cuda")
    impl = ImplSpec(profile=r["model"], attention=r["attention"], recompute=r["recompute"], device=device,
                    float8=r.get("float8", "none"))
    source = spec if r["model"] == "reference" else r["config"]
    row = {k: v for k, v in r.items() if k != "config"}
    e = estimate(spec, step, impl)
    row["estimate_bytes"], row["estimate_paged_bytes"] = e.peak_bytes, e.totals_bytes.get("paged_optimizer_state", 0)
    row["trace_bytes"] = row["trace_reserved_bytes"] = None
    if not step.optimizer.startswith("torchao-"):
        t0 = time.perf_counter()
        tr = trace_step(source, step, impl)
        row["trace_bytes"], row["trace_reserved_bytes"] = tr.peak_bytes, tr.peak_reserved_bytes
        row["trace_s"] = round(time.perf_counter() - t0, 2)
    try:
        m = profile_model(source, step, impl, device=device, steps=2, warmup=1,
                          modules=False).ranks[0]
    except OutOfMemory as exc:
        row["status"] = f"out of memory ({str(exc)[:80]})"
        return row
    row.update(status="ok", allocated_bytes=m.peak_bytes, reserved_bytes=m.peak_reserved_bytes,
               tokens_per_s=m.tokens_per_s, context_bytes=m.context_bytes,
               estimate_error_pct=error_pct(row["estimate_bytes"], m.peak_bytes),
               trace_error_pct=_pct(row["trace_bytes"], m.peak_bytes),
               trace_reserved_error_pct=_pct(row["trace_reserved_bytes"], m.peak_reserved_bytes))
    return row


def _pct(predicted, measured):
    return None if predicted is None else error_pct(predicted, measured)


def render(rows: list[dict], header: dict) -> str:
    def b(v):
        return "n/a" if v is None else fmt_bytes(v)

    def p(v):
        return "" if v is None else f"{v:+.1f}%"

    out = ["# Estimate vs trace vs measurement" + (" (CPU dry run)" if header["cpu"] else ""), "",
           f"- device: {header['device']}", f"- torch {header['torch']}, python {header['python']}",
           f"- model: {header['model']}; batch 1; AdamW unless the row names another optimizer; errors are "
           "(predicted − measured) / measured",
           f"- wall time: {header['wall_s']:.0f} s", ""]
    if header["cpu"]:
        out += ["CPU dry run: peaks are live-set bytes, reserved is n/a; only checks that the script works.", ""]
    out += ["| model | attention | recompute | precision | seq | estimate | trace | allocated | reserved | "
            "est. err | trace err | trace reserved err | tokens/s | outside allocator | status |",
            "|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        tps = "" if r.get("tokens_per_s") is None else f"{r['tokens_per_s']:,.0f}"
        name = r.get("optimizer", "adamw")
        suffix = ("" if name == "adamw" else f" {name}") + (f" float8 {r['float8']}" if r.get("float8") else "")
        paged = f" (+{b(r['estimate_paged_bytes'])} paged)" if r.get("estimate_paged_bytes") else ""
        out.append(f"| {r['model']} | {r['attention']} | {r['recompute']} | {r['precision']}"
                   f"{suffix} | {r['seq']} | "
                   f"{b(r.get('estimate_bytes'))}{paged} | {b(r.get('trace_bytes'))} | {b(r.get('allocated_bytes'))} | "
                   f"{b(r.get('reserved_bytes'))} | {p(r.get('estimate_error_pct'))} | {p(r.get('trace_error_pct'))} | "
                   f"{p(r.get('trace_reserved_error_pct'))} | {tps} | {b(r.get('context_bytes'))} | {r['status']} |")
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cpu", "--dry-run", dest="cpu", action="store_true", help="tiny sizes on CPU")
    ap.add_argument("--out-dir", default=str(ROOT / "bench" / "results"))
    ap.add_argument("--budget-s", type=float, default=450.0, help="stop starting runs after this many seconds")
    ap.add_argument("--limit", type=int, default=None, help="only the first N runs")
    args = ap.parse_args(argv)

    import torch

    if not args.cpu and not torch.cuda.is_available():
        sys.stderr.write("gpu_validate: no CUDA device; run with --cpu for the dry run\n")
        return 2
    device = "cpu" if args.cpu else "cuda"
    runs = plan(args.cpu)[: args.limit]
    t0 = time.perf_counter()
    rows = []
    for r in runs:
        if time.perf_counter() - t0 > args.budget_s:
            rows.append({**{k: v for k, v in r.items() if k != "config"}, "status": "skipped (time budget)"})
            continue
        rows.append(run_one(r, device))
        print(f"{rows[-1]['model']:9} {rows[-1]['attention']:5} {rows[-1]['recompute']:4} "
              f"{rows[-1]['precision']:8} S={rows[-1]['seq']:5}  {rows[-1]['status']}", file=sys.stderr)
    header = {"cpu": args.cpu, "device": "cpu" if args.cpu else f"cuda ({torch.cuda.get_device_name()})",
              "torch": torch.__version__, "python": platform.python_version(),
              "model": "tiny Llama (H=64, 2 layers)" if args.cpu else "Llama-2-7B widths, 2 layers",
              "wall_s": time.perf_counter() - t0}
    stem = "gpu_validate_cpu" if args.cpu else "gpu_validate"
    out = Path(args.out_dir)
    write_text_atomic(out / f"{stem}.json", json.dumps({"header": header, "rows": rows}, indent=1) + "\n")
    text = render(rows, header)
    write_text_atomic(out / f"{stem}.md", text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
