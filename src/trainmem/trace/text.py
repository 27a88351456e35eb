"""Plain-text rendering of a TraceResult."""

from __future__ import annotations

from trainmem.trace.result import TraceResult

__all__ = ["render_trace"]


def _gib(n: int) -> str:
    return f"{n / 2**30:10.3f} GiB"


def render_trace(r: TraceResult, *, top: int = 10, modules: int = 10) -> str:
    step = r.meta.get("step", {})
    impl = r.meta.get("impl", {})
    head = (f"trace: {r.meta.get('model', 'model')}, batch {step.get('batch', '?')}, seq {step.get('seq', '?')}, "
            f"{step.get('precision', '?')}, {step.get('optimizer', '?')} ({impl.get('optimizer_impl', '?')}"
            f"{', in backward' if impl.get('optimizer_in_backward') else ''}), attention {impl.get('attention', '?')}, "
            f"recompute {impl.get('recompute', '?')}, {'fake' if r.meta.get('fake', True) else 'real'} tensors")
    lines = [
        head,
        *([f"precision: {step['precision_description']}"] if "precision_description" in step else []),
        f"peak allocated   {_gib(r.peak_bytes)}  at {r.peak_phase} / {r.peak_module or '<root>'} / {r.peak_op}",
        f"reserved (model) {_gib(r.reserved_peak_bytes)}  expandable_segments: {_gib(r.reserved_peak_expandable_bytes).strip()}"
        f", fragmentation at peak {r.fragmentation:.1%}",
        "",
        "alive at the peak:",
        *(f"  {k:<16}{_gib(v)}" for k, v in r.totals_at_peak_bytes.items() if v),
        "",
        f"largest {top} tensors at the peak:",
        *(f"  {t.bytes / 2**20:12.2f} MiB  {t.category.value:<15} {t.name}" for t in r.top_at_peak[:top]),
    ]
    if modules:
        biggest = sorted(r.modules, key=lambda m: -m.backward_peak_bytes)[:modules]
        lines += ["", f"module peaks (top {modules} by backward peak):  forward / backward",
                  *(f"  {m.name or '<root>':<48}{_gib(m.forward_peak_bytes)} {_gib(m.backward_peak_bytes)}"
                    for m in biggest)]
    return "\n".join(lines)
