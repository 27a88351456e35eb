"""Text renderers for profiles, sweeps, comparisons and variants (compute never prints)."""

from __future__ import annotations

from trainmem.report.units import fmt_bytes

__all__ = ["render_profile", "render_sweep", "render_compare", "render_key_rows", "render_variants"]


def _b(n) -> str:
    return "n/a" if n is None else fmt_bytes(n)


def _pct(v) -> str:
    return "" if v is None else f"{v:+.1f}%"


def _rate(v) -> str:
    return "n/a" if v is None else f"{v:,.0f}"


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(header)]
    fmt = lambda cells: "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths)))
    return [fmt(header), fmt(["-" * w for w in widths]), *(fmt(r) for r in rows)]


def render_profile(result, *, top_modules: int = 10) -> str:
    r0 = result.ranks[0]
    cuda = result.device.startswith("cuda")
    desc = (result.meta or {}).get("step", {}).get("precision_description")
    out = [f"device: {result.device}" + ("" if cuda else "  (peaks are live-set bytes; reserved n/a on CPU)"),
           *([f"precision: {desc}"] if desc else []),
           f"peak allocated: {_b(result.peak_bytes)}",
           f"peak reserved:  {_b(result.peak_reserved_bytes)}" + ("" if cuda else "  (reserved n/a on CPU)"),
           f"tokens/s:       {_rate(result.tokens_per_s)}  (step {r0.step_time_s * 1e3:.1f} ms)"]
    if cuda:
        out.append(f"peak active:    {_b(r0.peak_active_bytes)}   alloc retries: {r0.num_alloc_retries}   "
                   f"OOMs: {r0.num_ooms}   outside the allocator (context, workspaces): {_b(r0.context_bytes)}")
    out.append("")
    out.append("ledgers (instrumented step):")
    out += ["  " + line for line in _table(["ledger", "bytes"], [[k, _b(v)] for k, v in r0.totals_bytes.items()])]
    if r0.categories_at_peak_bytes:
        out.append("")
        out.append("at the peak, by torch profiler category:")
        cats = sorted(r0.categories_at_peak_bytes.items(), key=lambda kv: -kv[1])
        out += ["  " + line for line in _table(["category", "bytes"], [[k, _b(v)] for k, v in cats if v])]
    if r0.modules and top_modules:
        out.append("")
        out.append(f"modules with the highest peaks (top {top_modules}; whole-process bytes while the module ran):")
        mods = sorted(r0.modules, key=lambda m: -max(m.forward_peak_bytes, m.backward_peak_bytes))[:top_modules]
        out += ["  " + line for line in _table(["module", "forward peak", "backward peak"],
                                               [[m.name, _b(m.forward_peak_bytes), _b(m.backward_peak_bytes)]
                                                for m in mods])]
    if len(result.ranks) > 1:
        out.append("")
        out.append("per rank:")
        out += ["  " + line for line in _table(
            ["rank", "device", "peak allocated", "peak reserved", "tokens/s", "OOMs"],
            [[str(r.rank), r.device, _b(r.peak_bytes), _b(r.peak_reserved_bytes), _rate(r.tokens_per_s),
              "n/a" if r.num_ooms is None else str(r.num_ooms)] for r in result.ranks])]
    if r0.items:
        out.append("")
        out.append(f"activations per tensor: {len(r0.items)} tensors, {_b(sum(i.bytes for i in r0.items))} "
                   "(--json items: keyed as estimate's and trace's)")
    if r0.snapshot:
        out.append("")
        out.append(f"memory snapshot: {r0.snapshot}  (open at https://pytorch.org/memory_viz)")
    return "\n".join(out)


def render_compare(table) -> str:
    rows = [[r.name, _b(r.estimate_bytes), _b(r.trace_bytes), _b(r.measured_bytes), _pct(r.estimate_error_pct),
             _pct(r.trace_error_pct)] for r in table.rows]
    out = _table(["", "estimate", "trace", "measured", "est. error", "trace error"], rows)
    if table.tensors:
        out += ["", *render_key_rows(table.tensors)]
    return "\n".join(out)


def render_key_rows(rows, *, limit: int = 12) -> list[str]:
    """Activations joined per tensor by key (``trainmem.join.KeyRow``): the keys whose sides differ."""
    sides = list(rows[0].items)
    same = sum(r.equal for r in rows)
    out = [f"activations per tensor, by key ({', '.join(sides)}): {same} of {len(rows)} keys hold the same "
           "dtype and bytes on every side"]
    differ = [r for r in rows if not r.equal]
    if differ:
        out += ["  " + line for line in _table(["key", *sides], [
            [r.key, *("-" if i is None else f"{_b(i.bytes)} {i.dtype}" for i in r.items.values())]
            for r in differ[:limit]])]
        out += [f"  ... and {len(differ) - limit} more (--json: compare.tensors)"] * (len(differ) > limit)
    return out


def render_sweep(result) -> str:
    unit = "tokens" if result.over == "seq" else "sequences"
    lim = "none (even the first value does not fit)" if result.max_fit is None else f"{result.max_fit} {unit}"
    if result.capped:
        stop = result.meta.get("stop")
        lim += f" (the largest value searched: --max or the model's positions, {stop}; the budget allows more)"
    out = [f"largest {result.over} within {fmt_bytes(result.budget_bytes)} ({result.backend}): {lim}"]
    flush = getattr(result, "max_fit_with_flush", result.max_fit)
    if flush is not None and flush != result.max_fit:  # the second bound (measure.sweeps.bisect_max_runs)
        out.append(f"largest {result.over} that runs only by flushing the allocator cache: {flush} {unit}"
                   + (" (the largest value searched)" if result.capped_with_flush else ""))
    desc = result.meta.get("step", {}).get("precision_description")
    out += [f"precision: {desc}"] * bool(desc) + [""]
    reserved = any(p.reserved_bytes is not None for p in result.points)  # trace, or measured on CUDA
    out += _table([result.over, "peak allocated", *(["reserved"] if reserved else []), "activation", "fits"],
                  [[str(p.value), "OOM" if p.peak_bytes is None else fmt_bytes(p.peak_bytes),
                    *([_b(p.reserved_bytes)] if reserved else []),
                    _b(p.totals_bytes.get("activation")) if p.totals_bytes else "n/a",
                    "yes" if p.fits else "flush" if p.fit_state == "fits_with_cache_flush" else "no"]
                   for p in result.points])
    if any(p.fit_state == "fits_with_cache_flush" for p in result.points):
        out.append("flush: the reserved peak is over the budget, but the step fits when the caching allocator frees "
                   "its cached segments on a failed cudaMalloc and retries (slower); not counted as fitting")
    out.append("")
    out.append(f"growth over {result.over} (log-log exponent; quadratic fit a·x² + b·x + c):")
    fits = [("ledger " + k, v) for k, v in result.fit["ledgers"].items() if v["exponent"] is not None]
    fits += [("term " + k, v) for k, v in result.fit["terms"].items() if v["exponent"] is not None]
    fits.append(("peak", result.fit["peak"]))
    out += ["  " + line for line in _table(["", "exponent", "a (B/unit²)", "b (B/unit)"],
                                           [[n, f"{v['exponent']:.3f}", f"{v['quadratic_coef']:.4g}",
                                             f"{v['linear_coef']:.4g}"] for n, v in fits])]
    out.append("")
    g = result.at_limit
    at = "" if not g or g["exponent"] is None else (
        f" at {result.over}={g['value']} (quadratic share {g['quadratic_share']:.0%}, local exponent {g['exponent']:.2f})")
    out.append(f"verdict: {result.verdict}{at}")
    cs = result.crossover_seq
    out.append("naive attention overtakes the linear terms at: "
               + ("never (no S·S term)" if cs is None else f"S ≈ {cs:,.0f}  ({result.crossover_source})"))
    return "\n".join(out)


def render_variants(result) -> str:
    rows = []
    for r in result.rows:
        rows.append([r.label, _b(r.peak_bytes), _b(r.peak_reserved_bytes), _rate(r.tokens_per_s),
                     "" if r.speed_ratio is None else f"{r.speed_ratio:.2f}x",
                     "" if r.loss is None else f"{r.loss:.5f}",
                     "" if r.loss_diff is None else f"{r.loss_diff:+.2e}",
                     "" if r.grad_norm_rel_diff is None else f"{r.grad_norm_rel_diff:.2e}", r.status])
    head = ["variant", "peak allocated", "peak reserved", "tokens/s", "speed", "loss (step 1)", "Δloss", "Δ|g|/|g|", "status"]
    out = [f"device: {result.device}" + ("" if result.device.startswith("cuda") else "  (reserved n/a on CPU)")]
    return "\n".join(out + _table(head, rows))
