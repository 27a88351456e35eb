"""The step peak of per-block ``torch.compile`` + full recompute on real CPU tensors: inductor proper against
trainmem's partition backend (the trace's graphs, unfused), beside the estimate and the fake trace.

A tiny Llama (H 64, F 176, 4/2 heads, V 256, 2 blocks), B 2, S 64, AdamW (foreach), SDPA; each block
checkpointed (transformers' non-reentrant checkpoint) and compiled alone (torchtitan's order). The real
peak is read from the profiler's allocator events (``profile_memory=True``: every CPU allocation, those of
inductor's generated code included, which no dispatch mode sees) on top of the baseline (parameters,
buffers, optimizer states), on the third step. On the partition backend the same method reads the
live-storage meter's peak (``trace.saved.step_peak_bytes``); the trace counts the token ids (B·S·8) and not
Adam's host step counters (4 B per parameter). Inductor compiles C++ with the host compiler: minutes.

    PYTHONPATH=src python bench/inductor_recompute_peak.py [--precision fp32 bf16]
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile

LLAMA = dict(model_type="llama", hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=256, max_position_embeddings=256, tie_word_embeddings=False)


def _allocations(prof) -> list[tuple[int, int]]:
    """(time in ns, +/- bytes) of every allocator event the profiler recorded, in time order."""
    from torch._C._profiler import _EventType

    out, stack = [], list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        e = stack.pop()
        if e.typed[0] == _EventType.Allocation:
            out.append((e.start_time_ns, e.typed[1].alloc_size))
        stack.extend(e.children)
    return sorted(out)


def real_peak(precision: str, backend: str) -> dict:
    import torch
    from torch.profiler import ProfilerActivity, profile

    from trainmem.models.hf import build_hf_model
    from trainmem.specs import ImplSpec, StepSpec
    from trainmem.trace.compiled import _compile_blocks, compile_model
    from trainmem.trace.optimizers import make_optimizer_for
    from trainmem.trace.recompute import enable_recompute
    from trainmem.trace.saved import step_peak_bytes

    step = StepSpec(batch=2, seq=64, precision=precision, optimizer="adamw")
    impl = ImplSpec(device="cpu", attention="sdpa", optimizer_impl="foreach", compile=True, compile_scope="block",
                    recompute="full")
    torch.manual_seed(0)
    old = torch.get_default_dtype()
    torch.set_default_dtype({"fp32": torch.float32, "bf16": torch.bfloat16}[precision])
    try:  # as the tracer builds it
        model = build_hf_model(LLAMA, attention="sdpa")
    finally:
        torch.set_default_dtype(old)
    model.train()
    enable_recompute(model, impl)
    torch._dynamo.reset()
    if backend == "partition":
        compile_model(model, impl)
    else:
        _compile_blocks(model, lambda block: torch.compile(block, backend="inductor", dynamic=False))
    _, _, opt = make_optimizer_for(model, step, impl)
    ids = torch.randint(0, LLAMA["vocab_size"], (step.batch, step.seq))

    def one_step():
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    one_step()
    one_step()
    held = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in (
        *model.parameters(), *model.buffers(), *(v for s in opt.state.values() for v in s.values()))}
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        one_step()
    live = peak = 0
    for _, size in _allocations(prof):
        live += size
        peak = max(peak, live)
    out = {"backend": backend, "precision": precision, "peak_bytes": sum(held.values()) + peak}
    if backend == "partition":
        out["live_storage_meter_bytes"] = step_peak_bytes(model, opt, one_step)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--precision", nargs="+", default=["fp32", "bf16"])
    args = p.parse_args()
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", tempfile.mkdtemp(prefix="inductor_"))  # no shared cache race
    from trainmem.estimate import estimate
    from trainmem.specs import ImplSpec, StepSpec
    from trainmem.specs.loaders import spec_from_hf_config
    from trainmem.trace import trace_step

    impl = ImplSpec(device="cpu", attention="sdpa", compile=True, compile_scope="block", recompute="full")
    for precision in args.precision:
        step = StepSpec(batch=2, seq=64, precision=precision, optimizer="adamw")
        row = {"precision": precision, "estimate_bytes": estimate(spec_from_hf_config(LLAMA), step, impl).peak_bytes,
               "trace_bytes": trace_step(LLAMA, step, impl).peak_logical_bytes}
        for backend in ("partition", "inductor"):
            row[backend] = real_peak(precision, backend)
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
