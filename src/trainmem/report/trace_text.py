"""Plain-text rendering of a TraceResult."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # report never imports the tracer back (tests/test_import_cycles.py)
    from trainmem.trace.result import TraceResult

__all__ = ["render_trace"]


def _gib(n: int) -> str:
    return f"{n / 2**30:10.3f} GiB"


def _finetune_words(ft: dict) -> str:
    words = f"finetune {ft['mode']}"
    if "lora_rank" in ft:
        words += f" r={ft['lora_rank']} on {','.join(ft['lora_targets'] or ['peft default'])}"
    return words + (f", frozen {','.join(ft['freeze'])}" if ft.get("freeze") else "")


def _header_lines(meta: dict) -> list[str]:
    """What was traced, naming only what the result records: ``trace_model`` results carry no
    batch, sequence, attention or recompute (your step decides them), so none is shown as ``?``."""
    step, impl, ft = meta.get("step", {}), meta.get("impl", {}), meta.get("finetune")
    optimizer = step.get("optimizer") or meta.get("optimizer")
    if optimizer and impl.get("optimizer_impl"):
        optimizer += f" ({impl['optimizer_impl']}{', in backward' if impl.get('optimizer_in_backward') else ''})"
    parts = [f"trace: {meta.get('model', 'model')}",
             *([f"batch {step['batch']}", f"seq {step['seq']}"] if "batch" in step and "seq" in step else []),
             *([step.get("precision") or meta.get("dtype")] if step.get("precision") or meta.get("dtype") else []),
             *([optimizer] if optimizer else []),
             *([f"attention {impl['attention']}"] if "attention" in impl else []),
             *([f"recompute {impl['recompute']}"] if "recompute" in impl else []),
             *([_finetune_words(ft)] if ft else []),
             *(["activations offloaded"] if meta.get("offload") else []),
             f"{'fake' if meta.get('fake', True) else 'real'} tensors"]
    lines, line = [], ""
    for part in parts:  # wrapped at 120 columns
        if line and len(line) + 2 + len(part) > 120:
            lines.append(line + ",")
            line = "  " + part
        else:
            line = f"{line}, {part}" if line else part
    lines.append(line)
    if "precision_description" in step:
        lines.append(f"precision: {step['precision_description']}")
    return lines


def torchtune_note(off: dict) -> str:
    return (f"min_offload_size {off['min_offload_size']} B, "
            + ("streams, forward stash " + str(off["max_fwd_stash_size"]) if off["use_streams"] else "no streams"))


def render_trace(r: TraceResult, *, top: int = 10, modules: int = 10) -> str:
    lines = [
        *_header_lines(r.meta),
        f"peak allocated   {_gib(r.peak_bytes)}  at {r.peak_phase} / {r.peak_module or '<root>'} / {r.peak_op}",
        f"reserved (model) {_gib(r.peak_reserved_bytes)}  expandable_segments: {_gib(r.peak_reserved_expandable_bytes).strip()}"
        f", fragmentation at peak {r.fragmentation:.1%}",
        "",
        "alive at the peak:",
        *(f"  {k:<16}{_gib(v)}" for k, v in r.totals_at_peak_bytes.items() if v and k != "paged_optimizer_state"),
        "",
        f"largest {top} tensors at the peak:",
        *(f"  {t.bytes / 2**20:12.2f} MiB  {t.category.value:<15} {t.name}" for t in r.top_at_peak[:top]),
    ]
    paged = r.totals_at_peak_bytes.get("paged_optimizer_state", 0)
    if paged:  # trace/low_bit_optim.py: bitsandbytes' managed buffers, never in the allocator's figures
        lines += ["", f"paged optimizer state (CUDA unified memory, outside PyTorch's allocator, not in the peak): "
                      f"{_gib(paged).strip()}"]
    off = r.meta.get("offload")
    if off:  # trace/offload.py: torchtune's host copies, never in the device figures above
        lines += ["", f"offloaded to host (not in the peak): {_gib(off['host_peak_bytes']).strip()} at most at once, "
                      f"one copy per pack ({torchtune_note(off)}); "
                      f"{_gib(off['offloaded_storage_bytes']).strip()} of distinct device storages"]
    if modules:
        biggest = sorted(r.modules, key=lambda m: -m.backward_peak_bytes)[:modules]
        lines += ["", f"module peaks (top {modules} by backward peak):  forward / backward",
                  *(f"  {m.name or '<root>':<48}{_gib(m.forward_peak_bytes)} {_gib(m.backward_peak_bytes)}"
                    for m in biggest)]
    return "\n".join(lines)
