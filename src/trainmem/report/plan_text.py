"""Plain-text renderers for plans, advice and explanations. Compute lives elsewhere."""

from __future__ import annotations

from collections import Counter

from trainmem.report.units import fmt_bytes

__all__ = ["render_plan", "render_advice", "render_explanation"]


def _cfg(c: dict) -> str:
    par = f"tp{c['tp']}{'+sp' if c['sp'] else ''} cp{c['cp']} pp{c['pp']} dp{c['dp']}"
    off = f" offload={','.join(c['offload'])}" if c["offload"] else ""
    rec = c["recompute"] + (f"(K={c['recompute_every']})" if c["recompute"] == "every-k" and "recompute_every" in c else "")
    return (f"mb={c['micro_batch']}×{c['grad_accum']} {c['attention']:<13} recompute={rec:<9} "
            f"{par:<26} zero{c['zero']}{off}{_axes(c)}")


def _axes(c: dict) -> str:
    """``plan --search``'s axes where a configuration leaves their defaults (trainmem.plan.axes)."""
    out = [f"optimizer={c['optimizer']}"] if "optimizer" in c else []
    if c.get("optimizer_impl", "auto") != "auto":
        out.append(f"optimizer-impl={c['optimizer_impl']}")
    if c.get("optimizer_in_backward"):
        out.append("optimizer-in-backward")
    if c.get("float8", "none") != "none":
        out.append(f"float8={c['float8']}")
    if c.get("compile"):
        out.append("compile" + (f"={c['compile_scope']}" if c.get("compile_scope", "model") != "model" else ""))
    return "".join(" " + o for o in out)


def render_plan(plan, *, rejected: bool = False, max_rejected: int = 50, max_pareto: int = 12) -> str:
    g = plan.gpu
    note = f"; {plan.global_batch_note}" if plan.global_batch_note else ""
    st = plan.stats
    lines = [
        f"trainmem plan — {plan.model.name}, seq {plan.step.seq}, global batch {plan.global_batch} sequences "
        f"({plan.global_batch * plan.step.seq:,} tokens/step{note}), {plan.step.precision} {plan.step.optimizer}",
        f"precision: {plan.step.precision_description}",
        f"hardware: {plan.gpus} × {g.name} ({fmt_bytes(g.memory_bytes)}, {g.bf16_flops / 1e12:g} TFLOP/s bf16, "
        f"{g.gpus_per_node}/node); usable per rank {fmt_bytes(plan.usable_bytes)} for the reserved peak after "
        f"reserving {fmt_bytes(plan.reserve.fixed_bytes)} (CUDA context, an estimate, and cuBLAS workspaces)"
        + (" + NCCL buffers" if plan.gpus > 1 else "") + f" + {plan.reserve.fraction:.0%} extra margin",
        "fits: the reserved peak (max_memory_reserved; the estimate replayed through the caching-allocator "
        "model) ≤ usable, as estimate --memory-figure reserved; 'flush' marks a configuration over it that fits "
        "only by flushing the allocator cache (slower, not ranked)",
        f"{screen_line(st)}; {st['checked']} checked with the per-rank estimate, which gives every peak shown; "
        f"{st['seconds']:.2f} s",
    ]
    for k in st.get("skipped_kernels", ()):
        lines.append(f"not offered: {k['attention']} + selective recompute ({k['why'].split(':')[0]}; "
                     "the same memory as recompute=none, one attention forward slower)")
    if "axes" in st:
        lines.append(f"also searched (--search): {', '.join(st['axes'])}")
        for why, n in Counter(k["why"] for k in st.get("skipped_variants", ())).most_common():
            lines.append(f"not searched: {n} saved set{'s' if n > 1 else ''}: {why}")
    if plan.gpu_counts:
        lines += [""] + gpu_count_lines(plan)
    lines.append("")
    fits = any(c.fits for c in plan.candidates)
    lines.append("Fastest configurations that fit" if fits else "Nothing fits; the configurations closest to fitting")
    w = max([len(_cfg(c.config)) for c in plan.candidates] + [len("configuration")])  # as wide as the widest row
    lines.append(f"  {'configuration':<{w}} {'allocated':>11} {'reserved':>11} {'step s':>8} {'tokens/s':>11}")
    for c in plan.candidates:
        lines.append(f"  {_cfg(c.config):<{w}} {fmt_bytes(c.peak_bytes):>11} {_res(c):>11} {c.step_time_s:>8.2f} "
                     f"{c.tokens_per_s:>11,.0f}" + ("  flush" if c.fit_state == "fits_with_cache_flush" else ""))
    if plan.candidates:
        t = plan.candidates[0].time_parts
        parts = ", ".join(f"{k[:-2]} {v:.3f}" for k, v in t.items() if v and k != "total_s")
        lines.append(f"  best step time by part (s): {parts}")
        lines.append(f"  peak in the {plan.candidates[0].peak_stage} stage, phase '{plan.candidates[0].peak_phase}' "
                     f"(per-rank peaks: {plan.candidates[0].peak_source})")
    if plan.pareto:
        lines += ["", "Memory vs. throughput (Pareto front: nothing is both smaller and faster)"]
        front = list(plan.pareto)
        if len(front) > max_pareto:  # evenly spaced, both ends kept
            front = [front[round(i * (len(front) - 1) / (max_pareto - 1))] for i in range(max_pareto)]
            lines.append(f"  ({max_pareto} of {len(plan.pareto)} shown; --json lists every one)")
        for c in front:
            lines.append(f"  {fmt_bytes(c.peak_bytes):>11} allocated {_res(c):>11} reserved "
                         f"{c.tokens_per_s:>11,.0f} tok/s  {_cfg(c.config)}")
    if rejected:
        lines += ["", f"Rejected: {len(plan.rejected):,}"]
        kinds = Counter(r.split(" ", 1)[0] + " …" if r.startswith("peak") else r for _, r in plan.rejected)
        for reason, n in kinds.most_common(12):
            lines.append(f"  {n:>7,} × {reason}")
        for cfg, reason in plan.rejected[:max_rejected]:
            lines.append(f"  {_cfg_or_partial(cfg):<{w}} {reason}")
        if len(plan.rejected) > max_rejected:
            lines.append(f"  ... {len(plan.rejected) - max_rejected:,} more (--json lists every one)")
    return "\n".join(lines)


def _res(c) -> str:
    """A candidate's reserved peak (allocator model), ``-`` where it was only screened."""
    return "-" if c.reserved_bytes is None else fmt_bytes(c.reserved_bytes)


def screen_line(st: dict) -> str:
    """The one wording of the search counts (the HTML report uses the same)."""
    return (f"screened {st['evaluated']:,} configurations, {st['fitting']:,} fit by the closed-form screen "
            f"({st['estimator_calls']} estimator calls)")


def gpu_count_lines(plan) -> list[str]:
    """``--gpus auto``: the counts tried and the answer."""
    counts = list(plan.gpu_counts)
    tried = ", ".join(f"{c['gpus']}: {'fits' if c['fits'] else 'no'}" for c in counts)
    found = next((c for c in counts if c["fits"]), None)
    if found is None:
        return [f"GPU counts tried ({tried}): none fits; the closest configurations at {plan.gpus} GPUs below"]
    out = [f"Smallest GPU count that fits: {found['gpus']} × {plan.gpu.name} (tried {tried})"]
    nxt = counts[-1] if counts[-1] is not found else None
    if nxt is not None:
        out.append(f"  next count, {nxt['gpus']} GPUs: {nxt['tokens_per_s'] / found['tokens_per_s']:.2f}× the "
                   f"tokens/s ({nxt['tokens_per_s']:,.0f} against {found['tokens_per_s']:,.0f})")
    return out


def _cfg_or_partial(c: dict) -> str:
    if c.get("micro_batch") is None:
        return f"tp{c['tp']} cp{c['cp']} pp{c['pp']} dp{c['dp']}" + (f" {c['attention']}" if c.get("attention") else "")
    return _cfg(c)


def render_advice(advice) -> str:
    lines = [
        f"trainmem advise — {advice.model.name}: peak {fmt_bytes(advice.start_peak_bytes)} allocated, "
        f"{fmt_bytes(advice.start_reserved_bytes)} reserved vs usable {fmt_bytes(advice.usable_bytes)} on "
        f"{advice.gpu.name}" + (f" × {advice.gpus}" if advice.gpus > 1 else ""),
        "fits: the reserved peak (the estimate replayed through the caching-allocator model) ≤ capacity − context"
        + (" − NCCL buffers" if advice.gpus > 1 else "")
        + (f" − {advice.reserve.fraction:.0%} extra margin" if advice.reserve.fraction else "")
        + ", as estimate --memory-figure reserved",
        f"precision: {advice.step.precision_description}",
        "",
    ]
    if advice.fit_state == "fits_with_cache_flush" and advice.flush is not None:
        from trainmem.report.fit_text import STATE_WORDS, flush_line
        f = advice.flush
        lines += [f"As it is: {STATE_WORDS[advice.fit_state]} (short by "
                  f"{fmt_bytes(advice.start_reserved_bytes - advice.usable_bytes)} against the reserved peak); "
                  "the changes below make it fit without flushing",
                  "  " + flush_line(f.flushes, f.flushed_bytes, f.reserved_bytes, advice.usable_bytes,
                                    advice.start_peak_bytes), ""]
    if advice.options:
        st = advice.stats
        lines.append(f"Cheapest changes that fit ({st.evaluated} estimates of {st.candidates} combinations of up to "
                     f"{st.max_changes} changes{'' if st.complete else f'; stopped at --max-estimates {st.budget}'}):")
        for i, o in enumerate(advice.options, 1):
            mark = "  [changes the training]" if o.changes_training else ""
            lines.append(f"{i}. {' + '.join(o.actions)}{mark}")
            lines.append(f"   peak {fmt_bytes(o.peak_bytes)} allocated, {fmt_bytes(o.reserved_bytes)} reserved, "
                         f"headroom {fmt_bytes(o.headroom_bytes)} against the reserved peak; "
                         f"{_speed(o.throughput_cost)}")
            lines.append(f"   {o.command}")
        lines += ["", "The usual fixes, applied one by one until it fits (the explanation):"]
    elif advice.stats is not None:
        st = advice.stats
        lines += [f"No combination of up to {st.max_changes} changes fits "
                  + (f"({st.why})." if st.why else f"({st.evaluated} estimates)."), ""]
    if not advice.steps:
        lines.append("It already fits: nothing to change." if advice.fits else "None of the usual fixes applies.")
    for i, s in enumerate(advice.steps, 1):
        lines.append(f"{i}. {s.action}")
        lines.append(f"   saves {fmt_bytes(s.saved_bytes)} → peak {fmt_bytes(s.peak_bytes_after)} allocated, "
                     f"{fmt_bytes(s.reserved_bytes_after)} reserved"
                     f"{'  (fits)' if s.reserved_bytes_after <= advice.usable_bytes else ''}; "
                     f"{_speed(s.throughput_cost)}")
        if s.note:
            lines.append(f"   {s.note}")
    if advice.skipped:
        lines += ["", "Not recommended (does not apply):"]
        for rung, why in advice.skipped:
            lines.append(f"  - {rung}: {why}")
    lines += ["", "Fits." if advice.fits else "Still does not fit after every usual fix; see `trainmem plan`."]
    return "\n".join(lines)


def _speed(throughput_cost: float) -> str:
    """``throughput_cost`` (1 − tokens/s after ÷ before) in words: "12% slower", "38% faster"."""
    if round(abs(throughput_cost), 2) == 0:
        return "same speed"
    return f"{abs(throughput_cost):.0%} {'slower' if throughput_cost > 0 else 'faster'}"


#: what every peak in ``explain``'s answers is: the estimate's (trainmem.plan.explain reads estimate().peak_bytes)
EXPLAIN_FIGURE = ("allocated (every peak below: live tensors' logical bytes; torch.cuda.memory_allocated rounds "
                  "each up to 512 B; reserved is larger, see its question)")


def render_explanation(ex) -> str:
    from trainmem.report.text import recompute_words
    lines = [f"trainmem explain — {ex.model.name}, B={ex.step.batch} S={ex.step.seq} {ex.step.precision} "
             f"{ex.step.optimizer}, framework={ex.impl.framework} attention={ex.impl.attention} "
             f"{recompute_words(ex.impl)}",
             f"precision: {ex.step.precision_description}",
             f"memory figure: {EXPLAIN_FIGURE}", ""]
    if ex.notes:
        lines += [f"Note: {n}" for n in ex.notes] + [""]
    for a in ex.answers:
        lines.append(f"Q: {a.question}")
        lines.append(f"A: {a.answer}")
        lines.append("")
    return "\n".join(lines).rstrip()
