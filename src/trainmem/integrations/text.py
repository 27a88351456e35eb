"""Log lines for a check and a measurement: rendered here, sent to the ``trainmem`` logger."""

from __future__ import annotations

import logging

from trainmem.integrations.check import Check, GuardReport
from trainmem.report.fit_text import flush_line
from trainmem.report.units import fmt_bytes

__all__ = ["check_lines", "measured_line", "log_check", "log_measured", "log"]

log = logging.getLogger("trainmem")


def _run(check: Check) -> str:
    r = check.run
    s, i = r.step, r.impl
    parts = [f"{r.model.name} B={s.batch} S={s.seq} accum={s.grad_accum} {s.precision} {s.optimizer}",
             f"attention={i.attention} recompute={i.recompute}" + (f"/{i.recompute_every}" if i.recompute == "every-k" else "")]
    if r.finetune is not None:
        parts.append(f"{r.finetune.mode} r={r.finetune.lora_rank} on {','.join(r.finetune.lora_targets)}")
    if not r.parallel.is_single:
        p = r.parallel
        parts.append(f"dp={p.dp} zero={p.zero}" + (f" fsdp={p.fsdp}" if p.fsdp else "")
                     + (f" offload={','.join(p.offload)}" if p.offload else ""))
    return ", ".join(parts)


def check_lines(check: Check) -> list[str]:
    """The prediction, the verdict, the fix when it does not fit, then every note."""
    head = f"trainmem: predicted peak {fmt_bytes(check.predicted_peak_bytes)} per device ({check.peak_phase}) for {_run(check)}"
    lines = [head]
    b = check.budget
    if b is None:
        lines.append("trainmem: no device memory to compare with (on CPU pass gpu= or gpu_memory=)")
    else:
        where = (f"reserved peak {fmt_bytes(check.predicted_reserved_bytes)} (allocator model), usable "
                 f"{fmt_bytes(b.usable_bytes)} of {fmt_bytes(b.gpu.memory_bytes)} ({b.source}; context "
                 f"{fmt_bytes(b.reserve.fixed_bytes)}" + (f" + {b.reserve.fraction:.0%} margin" if b.reserve.fraction
                                                           else "") + ", as plan and advise"
                 + ("; the reserve alone exceeds the capacity)" if b.usable_bytes <= 0 else ")"))
        over = check.predicted_reserved_bytes - b.usable_bytes
        if check.fits:
            lines.append(f"trainmem: fits: {where}")
        elif check.fit_state == "fits_with_cache_flush":
            f = check.flush
            lines.append(f"trainmem: fits ONLY BY FLUSHING THE ALLOCATOR CACHE (reserved peak over by "
                         f"{fmt_bytes(over)}): {where}")
            lines.append("trainmem: " + flush_line(f.flushes, f.flushed_bytes, f.reserved_bytes, b.usable_bytes,
                                                   check.predicted_peak_bytes))
            lines.extend(_fix_lines(check, "to fit without flushing"))
        else:
            lines.append(f"trainmem: does NOT fit by {fmt_bytes(over)}: {where}")
            lines.extend(_fix_lines(check))
    lines.extend(f"trainmem note: {n}" for n in (*check.run.notes, *check.notes))
    return lines


def _fix_lines(check: Check, goal: str = "until it fits") -> list[str]:
    a = check.advice
    if a is None:
        return []
    if not a.steps:
        return ["trainmem: none of advise's usual fixes applies here"]
    out = [f"trainmem: cheapest fix (advise's usual fixes, applied in order {goal}):"]
    for n, s in enumerate(a.steps, 1):
        out.append(f"trainmem:   {n}. {s.action}: peak → {fmt_bytes(s.peak_bytes_after)} "
                   f"(saves {fmt_bytes(s.saved_bytes)}, throughput cost {s.throughput_cost:+.0%})")
    if not a.fits:
        out.append("trainmem:   still does not fit after every one")
    return out


def measured_line(report: GuardReport) -> str:
    m, c = report.measured, report.check
    steps = len(m.step_peaks_bytes)
    reserved = f", reserved {fmt_bytes(m.peak_reserved_bytes)}" if m.peak_reserved_bytes is not None else ""
    verdict = "within" if report.agrees else "OUTSIDE"
    return (f"trainmem: step peak predicted {fmt_bytes(c.predicted_peak_bytes)}, measured {fmt_bytes(m.peak_bytes)}"
            f"{reserved} ({m.source} on {m.device}, first {steps} step{'s' if steps > 1 else ''}); "
            f"measured/predicted = {report.ratio:.3f}, {verdict} the {report.tolerance:.0%} tolerance")


def log_check(check: Check) -> None:
    """INFO when it fits (like the Trainer's own run summary), WARNING when it does not, or only by
    flushing the allocator cache."""
    level = logging.WARNING if check.fits is False else logging.INFO
    for line in check_lines(check):
        log.log(level, line)


def log_measured(report: GuardReport) -> None:
    log.log(logging.INFO if report.agrees else logging.WARNING, measured_line(report))
