"""The HTML page of a plan (schema ``trainmem.plan``): the screen counts, peak against throughput, the best configurations."""

from __future__ import annotations

from trainmem.report.html_base import _Page, _ranks, line_chart, table
from trainmem.report.units import fmt_bytes


def _config_text(c: object) -> str:
    if isinstance(c, dict):
        return " ".join(f"{k}={v}" for k, v in c.items()
                        if v not in (None, False, 1, "none", (), []) or k in ("batch", "micro_batch"))
    return str(c)


def _plan(d: dict, page: _Page) -> None:
    cands = d.get("candidates", [])
    fits = [c for c in cands if c.get("fits")]
    inp = d.get("inputs", {})
    gpu = inp.get("gpu", {})
    gpu = gpu.get("name", "") if isinstance(gpu, dict) else gpu
    batch = inp.get("global_batch") and f"global batch {inp['global_batch']} sequences" + (
        f" ({inp['global_batch_note']})" if inp.get("global_batch_note") else "")
    seq = (inp.get("step") or {}).get("seq")
    page.subtitle = " · ".join(str(x) for x in ((inp.get("model") or {}).get("name"), seq and f"S={seq}", batch,
                                                 gpu and f"{inp.get('gpus', '?')} × {gpu}") if x)
    # the same counts, in the same words, as the text report (trainmem.report.plan_text.screen_line)
    st = d.get("search", {})
    if "evaluated" in st:
        page.card("configurations screened", f"{st['evaluated']:,}")
        page.card("fit by the closed-form screen", f"{st.get('fitting', 0):,}")
    if "checked" in st:
        page.card("checked with the per-rank estimate", f"{st['checked']:,}")
    page.card("shown that fit", f"{len(fits):,} of {len(cands):,}")
    found = next((c for c in d.get("gpu_counts", []) if c.get("fits")), None)
    if found:
        page.card("smallest GPU count that fits", f"{found['gpus']:,}", peak=True)
    best = max(fits, key=lambda c: c.get("tokens_per_s") or 0, default=None)
    if best:
        page.card("best tokens/s", f"{best.get('tokens_per_s', 0):,.0f}", peak=True)
        page.card("its peak per rank", fmt_bytes(best.get("peak_bytes", 0)))
    usable = d.get("reserve", {}).get("usable_bytes")
    if usable:
        page.card("usable per rank", fmt_bytes(usable))
    if not cands:
        return

    def pts(cs: list[dict]) -> tuple[list, list]:
        cs = [c for c in cs if c.get("tokens_per_s") is not None]
        return [c["tokens_per_s"] for c in cs], [c.get("peak_bytes", 0) for c in cs]

    series = []
    if len(fits) < len(cands):
        series.append(("does not fit", *pts([c for c in cands if not c.get("fits")]), "#b8bcc6", "points"))
    if fits:
        series.append(("fits", *pts(fits), "#2a7f3f", "points"))
    pareto = [p for p in d.get("pareto", []) if isinstance(p, dict)]
    if pareto:
        series.append(("Pareto front", *pts(sorted(pareto, key=lambda c: c.get("tokens_per_s") or 0)), "#c00", "line"))
    if usable:
        xs = [c["tokens_per_s"] for c in cands + pareto if c.get("tokens_per_s") is not None] or [0]
        series.append(("usable memory", [min(xs), max(xs)], [usable, usable], "#222", "dash"))
    page.section("Peak per rank against throughput", line_chart(series, xlabel="tokens/s"))
    ranked = sorted(cands, key=lambda c: (not c.get("fits"), -(c.get("tokens_per_s") or 0)))[:50]
    page.section("Best configurations", table(
        ["config", "peak per rank", "step time (s)", "tokens/s", "fits"],
        [[_config_text(c.get("config")), fmt_bytes(c.get("peak_bytes", 0)), f"{c.get('step_time_s') or 0:.3f}",
          f"{c.get('tokens_per_s') or 0:,.0f}",
          "yes" if c.get("fits") else "flush" if c.get("fit_state") == "fits_with_cache_flush" else "no"]
         for c in ranked],
        numeric=(1, 2, 3), highlight=0 if best else None))
    if d.get("rejected"):
        page.section("Rejected", table(["config", "why"], [[_config_text(r.get("config")), r.get("reason", "")]
                                                          for r in d["rejected"][:200]]))
    _ranks((best or {}).get("ranks"), page)
