"""One row of ``bench/gpu_validate.py``: the estimate, the trace and the measured step, with their errors.

The measured step is trainmem's own (``trainmem.measure.build_workload`` then ``profile_workload``), the
step the estimate and the trace describe. Under ``compile_scope`` it is compiled here after the
optimizer exists, as ``trainmem.trace.step.trace_step`` does: each decoder block replaced in its parent
by ``torch.compile(block)`` (torchtitan's ``apply_compile``; ``trace/compiled.py`` ``_compile_blocks``)
or ``torch.compile(model)``. On CUDA the backend is inductor's default, which generates kernels: the
point of the row. On CPU (the dry run) it is the trace's ``trainmem_partition`` backend (inductor's
decompositions, joint-graph passes and min-cut partition, no code generation): the row says so. Real
inductor on CPU is not measurable here: the CPU meter is a dispatch mode (``trace/storages.py``), and
inductor's checkpointed regions call the ``run_and_save_rng_state`` higher-order op, which it refuses
(NotImplementedError, tried on compile-block-full); the CUDA meter reads the allocator's counters instead.

The four figures (``trainmem.fits``, ``--memory-figure``): allocated, active (torchtune's
``active_bytes.all.peak``), reserved, device (nvidia-smi: reserved + the CUDA context). Estimate:
allocated = its peak, active = allocated (no second stream), reserved = its allocation order replayed
through the allocator model (``estimate.allocation_order.estimate_reserved``), device = reserved + the
GPU preset's context (``fits.context_bytes``). Trace: allocated (block-rounded) and logical bytes,
reserved from its allocator replay, device = reserved + the preset's context. Measured: the allocator's
peaks after a warm-up step, device = peak reserved + the context measured by ``torch.cuda.mem_get_info``
(used − reserved at the end of the step).
"""

from __future__ import annotations

import importlib.util
import time

from gpu_validate_plan import Run

from trainmem.measure.compare import error_pct
from trainmem.specs import ImplSpec, StepSpec
from trainmem.specs.loaders import spec_from_hf_config

__all__ = ["run_one", "missing_libraries", "gpu_preset", "CPU_BACKEND"]

CPU_BACKEND = "trainmem_partition"


def missing_libraries(run: Run) -> list[str]:
    return [name for name in run.needs if importlib.util.find_spec(name) is None]


def specs(run: Run, device: str) -> tuple[StepSpec, ImplSpec]:
    step = StepSpec(batch=1, seq=run.seq, precision=run.precision, optimizer=run.optimizer)
    # the kernels modelled are the device's own (the brief's GPU rows: device="cuda")
    impl = ImplSpec(profile=run.model, attention=run.attention, recompute=run.recompute, device=device,
                    float8=run.float8, optimizer_impl=run.optimizer_impl,
                    optimizer_in_backward=run.optimizer_in_backward, compile=run.compile_scope is not None,
                    compile_scope=run.compile_scope or "model")
    return step, impl


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0][:160] if text else ''}".rstrip(": ")


def _compile(workload, impl: ImplSpec, device) -> str:
    """Compile the built workload's model as the trace compiles it (``trace/compiled.py`` ``compile_model``);
    returns the backend's name."""
    import torch

    from trainmem.trace.compiled import Compiled, decoder_blocks, partitioning_backend

    backend = "inductor" if device.type == "cuda" else partitioning_backend(Compiled())
    torch._dynamo.reset()  # a fresh cache per row: an earlier row's model must not count toward the recompile limit

    def compiled(module):
        return torch.compile(module, backend=backend, dynamic=False)

    if impl.compile_scope == "block":
        blocks = decoder_blocks(workload.model)
        for parent, name, block in blocks:
            parent.register_module(name, compiled(block))
        # transformers' blocks guard on their cache layer's index: one recompile per block (trace/compiled.py)
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, len(blocks))
    else:
        workload.model = compiled(workload.model)
    return "inductor" if device.type == "cuda" else CPU_BACKEND


def _measure(source, step: StepSpec, impl: ImplSpec, device: str) -> tuple[object, str | None]:
    """The measured step's rank profile, and the compile backend it ran under (None: eager)."""
    from trainmem.measure.profiling import profile_workload, release_memory
    from trainmem.measure.workload import build_workload, resolve_device

    dev = resolve_device(device)
    w = None
    try:
        w = build_workload(source, step, impl, device=dev, seed=0)
        backend = _compile(w, impl, dev) if impl.compile else None
        # tensors=False: the per-tensor forward record puts module hooks inside the compiled regions
        prof = profile_workload(w, steps=2, warmup=1, modules=False, tensors=False)
        return prof.ranks[0], backend
    finally:
        if w is not None:
            w.close()
        del w
        if impl.compile:  # Dynamo's cache holds the compiled modules (and through them the weights)
            import torch
            torch._dynamo.reset()
        release_memory()


#: (a word of ``torch.cuda.get_device_name()``, the preset whose context the device figure adds); first match wins
_PRESETS = (("h200", "h200"), ("h100", "h100-80gb"), ("b200", "b200"), ("a100-sxm4-40gb", "a100-40gb"),
            ("a100", "a100-80gb"), ("mi300x", "mi300x"), ("4090", "rtx-4090"), ("l4", "l4"))


def gpu_preset(device: str):
    """The GPU preset whose CUDA context the estimate's and the trace's device figure add: the one the
    device's name names on CUDA (H200's when none does), H200's on CPU (arithmetic only)."""
    from trainmem.plan.hardware import load_gpu

    name = "h200"
    if device == "cuda":
        import torch
        dev = torch.cuda.get_device_name().lower()
        name = next((preset for word, preset in _PRESETS if word in dev), name)
    return load_gpu(name, memory_only=True)


def _pct(predicted, measured):
    return None if predicted is None or not measured else error_pct(predicted, measured)


def run_one(run: Run, config: dict, device: str) -> dict:
    """The row for ``run``: every stage guarded, so a failure is the row's one-line status, never an abort
    (a KeyboardInterrupt, the script's SIGTERM, still stops the run)."""
    row = {"id": run.id, **run.settings()}
    missing = missing_libraries(run)
    if missing:
        row["status"] = f"not run: {', '.join(missing)} not installed"
        return row
    try:
        return _stages(run, config, device, row)
    except Exception as exc:  # noqa: BLE001 - whatever a foreign image raises is the row's finding
        row["status"] = f"failed: {_one_line(exc)}"
        return row


def _stages(run: Run, config: dict, device: str, row: dict) -> dict:
    """Estimate, trace and measure ``run`` into ``row``; a refused estimate or trace is a note, the step's
    failure the status."""
    from trainmem.estimate import estimate
    from trainmem.estimate.allocation_order import estimate_reserved
    from trainmem.fits import context_bytes
    from trainmem.measure.profiling import OutOfMemory
    from trainmem.trace import trace_step

    spec = spec_from_hf_config(config, name="tiny" if config["vocab_size"] <= 1000 else "llama-2-7b-2L")
    source = spec if run.model == "reference" else config
    step, impl = specs(run, device)
    gpu = gpu_preset(device)
    notes = []
    try:
        e = estimate(spec, step, impl)
        reserved = estimate_reserved(e).reserved_bytes
        row.update(estimate_bytes=e.peak_bytes, estimate_phase=e.peak.name, estimate_reserved_bytes=reserved,
                   estimate_device_bytes=reserved + context_bytes(gpu),
                   estimate_paged_bytes=e.totals_bytes.get("paged_optimizer_state", 0))
    except Exception as exc:  # noqa: BLE001 - a refusal is the row's finding
        notes.append(f"estimate: {_one_line(exc)}")
    if not step.optimizer.startswith("torchao-"):  # the tracer refuses torchao's optimizers
        t0 = time.perf_counter()
        try:
            tr = trace_step(source, step, impl)
            row.update(trace_bytes=tr.peak_bytes, trace_logical_bytes=tr.peak_logical_bytes,
                       trace_reserved_bytes=tr.peak_reserved_bytes,
                       trace_device_bytes=tr.peak_reserved_bytes + context_bytes(gpu),
                       trace_s=round(time.perf_counter() - t0, 2))
            del tr
        except Exception as exc:  # noqa: BLE001
            notes.append(f"trace: {_one_line(exc)}")
    claim = run.cpu_claim
    if device == "cpu" and claim is not None and "estimate_bytes" in row and "trace_logical_bytes" in row:
        row["cpu_claim"] = {"source": claim.source, "holds": claim.holds(
            estimate_bytes=row["estimate_bytes"], estimate_phase=row["estimate_phase"],
            trace_bytes=row["trace_logical_bytes"])}
    try:
        m, backend = _measure(source, step, impl, device)
    except OutOfMemory as exc:
        row["status"] = f"out of memory ({str(exc)[:80]})"
        return _noted(row, notes)
    except Exception as exc:  # noqa: BLE001
        row["status"] = f"measure failed: {_one_line(exc)}"
        return _noted(row, notes)
    if backend is not None:
        row["compile_backend"] = backend
        if backend == CPU_BACKEND:
            notes.append(f"measured compiled with {CPU_BACKEND} (the trace's backend: inductor's partition, "
                         "no codegen), not inductor")
    device_bytes = (m.peak_reserved_bytes + m.context_bytes if m.peak_reserved_bytes is not None
                    and m.context_bytes is not None else None)
    row.update(status="ok", allocated_bytes=m.peak_bytes, active_bytes=m.peak_active_bytes,
               reserved_bytes=m.peak_reserved_bytes, device_bytes=device_bytes, context_bytes=m.context_bytes,
               tokens_per_s=m.tokens_per_s)
    g = row.get
    row.update(estimate_error_pct=_pct(g("estimate_bytes"), m.peak_bytes),
               estimate_active_error_pct=_pct(g("estimate_bytes"), m.peak_active_bytes),
               estimate_reserved_error_pct=_pct(g("estimate_reserved_bytes"), m.peak_reserved_bytes),
               estimate_device_error_pct=_pct(g("estimate_device_bytes"), device_bytes),
               # CUDA's allocated peak is in allocator blocks (the trace's rounded peak); CPU's live set is in
               # logical bytes
               trace_error_pct=_pct(g("trace_bytes" if device == "cuda" else "trace_logical_bytes"), m.peak_bytes),
               trace_reserved_error_pct=_pct(g("trace_reserved_bytes"), m.peak_reserved_bytes),
               trace_device_error_pct=_pct(g("trace_device_bytes"), device_bytes))
    return _noted(row, notes)


def _noted(row: dict, notes: list[str]) -> dict:
    if notes:
        row["notes"] = notes
    return row

