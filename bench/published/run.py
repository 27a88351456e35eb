"""trainmem against published GPU peak-memory figures (bench/published/cases.json).

    python bench/published/run.py               # every case; writes bench/results/published.{md,json}
    python bench/published/run.py --only ID,ID  # a few cases, nothing written

Each case is a figure someone measured on a GPU and published with its setup. The case's
trainmem arguments reproduce that setup as closely as trainmem can today; `unmodelled` lists
what trainmem cannot express yet. This script runs `trainmem estimate --json` in-process per
case and compares its peak with the figure: the allocated peak, or the figure the case's args
name with --memory-figure (reserved for torchtitan's max reserved: the estimate's allocation order
replayed through the caching-allocator model, trainmem/estimate/allocation_order.py). Nothing here is tuned to a case: the
arguments follow the source, and where the source is silent the case says what was assumed.

Comparison kinds (figure.compare): "allocated" when the figure is max_memory_allocated or
torchtune's peak active (both count live blocks); "reserved" when it is the caching allocator's
reserved peak (torchtitan), compared with trainmem's reserved figure (its args carry
--memory-figure reserved); "unclear" when the source does not say which counter, compared with
the allocated peak. A case with a `doubt` has a figure that
contradicts its own stated setup; it is run and shown, and summarized apart.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
CASES = HERE / "cases.json"
RESULTS = ROOT / "bench" / "results"

REQUIRED = {
    "id": str, "source": dict, "model": str, "model_arg": str, "setup": dict, "figure": dict,
    "args": list, "unmodelled": list, "clarity": str, "assumptions": list,
}
SOURCE_KEYS = ("url", "repo", "path", "commit", "quote")
FIGURE_KEYS = ("value", "unit", "bytes", "measures", "compare")
COMPARE_KINDS = ("allocated", "reserved", "unclear")
UNIT_BYTES = {"GiB": 2**30, "GB": 10**9, "bytes": 1}
CLARITIES = ("clear", "partial")
ENGINES = ("estimate", "trace")
"""A case's optional ``engine``: ``estimate`` (default) or ``trace``, the fake-tensor trace of the
real Hugging Face model, for a family the estimator has no rules for (its peak_bytes, the allocated peak)."""


def load_cases(path: Path = CASES) -> list[dict]:
    """The cases, each validated; a bad entry raises ValueError naming its id and field."""
    doc = json.loads(path.read_text())
    cases = doc["cases"]
    seen = set()
    for i, c in enumerate(cases):
        cid = c.get("id", f"#{i}")
        for key, typ in REQUIRED.items():
            if not isinstance(c.get(key), typ):
                raise ValueError(f"case {cid}: field {key!r} must be {typ.__name__}, got {c.get(key)!r}")
        for key in SOURCE_KEYS:
            if not c["source"].get(key):
                raise ValueError(f"case {cid}: source.{key} is empty")
        for key in FIGURE_KEYS:
            if key not in c["figure"]:
                raise ValueError(f"case {cid}: figure.{key} is missing")
        fig = c["figure"]
        if fig["unit"] not in UNIT_BYTES:
            raise ValueError(f"case {cid}: figure.unit={fig['unit']!r} must be one of {sorted(UNIT_BYTES)}")
        if fig["bytes"] != round(fig["value"] * UNIT_BYTES[fig["unit"]]):
            raise ValueError(f"case {cid}: figure.bytes={fig['bytes']} is not {fig['value']} {fig['unit']}")
        if fig["compare"] not in COMPARE_KINDS:
            raise ValueError(f"case {cid}: figure.compare={fig['compare']!r} must be one of {COMPARE_KINDS}")
        if c.get("engine", "estimate") not in ENGINES:
            raise ValueError(f"case {cid}: engine={c['engine']!r} must be one of {ENGINES}")
        if not isinstance(c.get("doubt", ""), str):
            raise ValueError(f"case {cid}: doubt must be a string")
        if c["clarity"] not in CLARITIES:
            raise ValueError(f"case {cid}: clarity={c['clarity']!r} must be one of {CLARITIES}")
        if c["clarity"] == "partial" and not c["assumptions"]:
            raise ValueError(f"case {cid}: clarity 'partial' needs its assumptions written down")
        if "--json" in c["args"] or "--model" in c["args"]:
            raise ValueError(f"case {cid}: args must not carry --json or --model (run.py adds them)")
        if cid in seen:
            raise ValueError(f"case {cid}: duplicate id")
        seen.add(cid)
    return cases


def comparison_kind(case: dict) -> str:
    return case["figure"]["compare"]


@dataclass(frozen=True)
class Outcome:
    case: dict
    status: str              # "ok" or "refused"
    predicted_bytes: int | None
    reason: str = ""

    @property
    def ratio(self) -> float | None:
        return None if self.predicted_bytes is None else self.predicted_bytes / self.case["figure"]["bytes"]


def run_case(case: dict) -> Outcome:
    """trainmem estimate --json (or the case's engine) for the case, in-process; trainmem's refusal
    (exit 2) is an outcome."""
    from trainmem.cli import main

    argv = [case.get("engine", "estimate"), "--model", str(ROOT / case["model_arg"]) if "/" in case["model_arg"] else case["model_arg"],
            *case["args"], "--json"]
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            rc = main(argv)
        except SystemExit as e:
            rc = e.code
    if rc not in (0, None):
        return Outcome(case, "refused", None, (err.getvalue().strip().splitlines() or [f"exit {rc}"])[-1])
    return Outcome(case, "ok", predicted_bytes(json.loads(out.getvalue())))


def predicted_bytes(result: dict) -> int:
    """The peak in the figure the case asked for (``memory_figure: {figure, peak_<figure>_bytes}``,
    schema /2, docs/schema.md), else the allocated peak (``peak_bytes``)."""
    fig = result.get("memory_figure")
    if not fig:
        return int(result["peak_bytes"])
    key = "peak_bytes" if fig["figure"] == "allocated" else f"peak_{fig['figure']}_bytes"
    return int(fig[key])


def summarize(outcomes: list[Outcome]) -> dict:
    ratios = [o.ratio for o in outcomes if o.status == "ok"]
    if not ratios:
        return {"cases": 0}
    worst = max(ratios, key=lambda r: abs(r - 1))
    return {
        "cases": len(ratios),
        "median_ratio": statistics.median(ratios),
        "worst_ratio": worst,
        "within_10pct": sum(abs(r - 1) <= 0.10 for r in ratios) / len(ratios),
        "within_25pct": sum(abs(r - 1) <= 0.25 for r in ratios) / len(ratios),
        "under": sum(r < 1 for r in ratios),
        "over": sum(r > 1 for r in ratios),
    }


def mechanism_ranking(outcomes: list[Outcome]) -> list[tuple[str, int, float | None]]:
    """(mechanism, cases it appears in, median ratio of those cases that ran), most cases first."""
    cases: dict[str, list[Outcome]] = {}
    for o in outcomes:
        for m in o.case["unmodelled"]:
            cases.setdefault(m, []).append(o)
    rows = []
    for m, os_ in cases.items():
        ratios = [o.ratio for o in os_ if o.status == "ok"]
        rows.append((m, len(os_), statistics.median(ratios) if ratios else None))
    return sorted(rows, key=lambda r: (-r[1], r[0]))


def _gib(b: int | None) -> str:
    return "—" if b is None else f"{b / 2**30:.2f}"


def _setup(c: dict) -> str:
    drop = {"gpu", "precision", "config", "code_commit", "torch", "bitsandbytes", "torchtitan", "recipe", "dataset", "loss"}
    return ", ".join(f"{k}={v}" for k, v in c["setup"].items() if k not in drop)


def _summary_lines(name: str, s: dict) -> list[str]:
    if not s.get("cases"):
        return [f"- {name}: no cases"]
    return [f"- {name}: {s['cases']} cases; median ratio {s['median_ratio']:.3f}; worst {s['worst_ratio']:.3f}; "
            f"within ±10%: {s['within_10pct']:.0%}; within ±25%: {s['within_25pct']:.0%}; "
            f"under {s['under']}, over {s['over']}"]


def render(outcomes: list[Outcome], summaries: dict, ranking, stamp: str) -> str:
    lines = [
        "# trainmem against published GPU peak memory",
        "",
        stamp,
        "",
        "ratio = trainmem estimate's peak (allocated; reserved where the case's args say --memory-figure "
        "reserved; `(trace)`: trainmem trace's allocated peak, for a family without estimator rules) / the "
        "published figure (1.00 = exact). Cases and sources: "
        "`bench/published/cases.json`; how to read them: `bench/published/README.md`.",
        "",
        "| id | model | setup | published | kind | published GiB | trainmem GiB | ratio | clarity | unmodelled |",
        "|---|---|---|---|---|---:|---:|---:|---|---|",
    ]
    for o in outcomes:
        c = o.case
        fig = f"{c['figure']['value']} {c['figure']['unit']}"
        engine = f" ({c['engine']})" if c.get("engine", "estimate") != "estimate" else ""
        ratio = f"{o.ratio:.3f}{engine}" if o.status == "ok" else f"refused: {o.reason}"
        lines.append(f"| {c['id']} | {c['model']} | {_setup(c)} | {fig} | {comparison_kind(c)} | "
                     f"{_gib(c['figure']['bytes'])} | {_gib(o.predicted_bytes)} | {ratio} | "
                     f"{c['clarity']}{' (doubt)' if c.get('doubt') else ''} | "
                     f"{'; '.join(c['unmodelled']) or '—'} |")
    refused = sum(o.status == "refused" for o in outcomes)
    lines += ["", "## Summary", "", f"{len(outcomes)} cases; {refused} refused by trainmem (kept out of the ratios).", ""]
    for name, s in summaries.items():
        lines += _summary_lines(name, s)
    doubts = [o.case for o in outcomes if o.case.get("doubt")]
    if doubts:
        lines += ["", "Doubtful figures (shown above, summarized apart):", "",
                  *(f"- {c['id']}: {c['doubt']}" for c in doubts)]
    lines += ["", "## Unmodelled mechanisms, by the number of cases each affects", "",
              "A case usually has several; the median ratio is over every case the mechanism appears in, so it "
              "mixes their effects.", "",
              "| mechanism | cases | median ratio of those cases |", "|---|---:|---:|",
              *(f"| {m} | {n} | {'—' if r is None else f'{r:.3f}'} |" for m, n, r in ranking), ""]
    return "\n".join(lines)


def _commit() -> str:
    """HEAD, and whether src/ differs from it (the estimate runs the working tree)."""
    def git(*a):
        return subprocess.run(["git", *a], cwd=ROOT, capture_output=True, text=True, check=True).stdout.strip()
    try:
        return git("rev-parse", "--short", "HEAD") + (" + uncommitted src/ changes" if git("status", "--porcelain", "--", "src") else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", help="comma-separated case ids; prints the table, writes nothing")
    args = ap.parse_args(argv)
    cases = load_cases()
    if args.only:
        wanted = args.only.split(",")
        unknown = sorted(set(wanted) - {c["id"] for c in cases})
        if unknown:
            print(f"error: --only: unknown case id(s) {', '.join(unknown)}", file=sys.stderr)
            return 2
        cases = [c for c in cases if c["id"] in wanted]
    outcomes = [run_case(c) for c in cases]
    ok = [o for o in outcomes if o.status == "ok"]
    sound = [o for o in ok if not o.case.get("doubt")]
    summaries = {
        "all cases run": summarize(ok),
        "without doubtful figures": summarize(sound),
        "no unmodelled mechanism": summarize([o for o in sound if not o.case["unmodelled"]]),
        "allocated-kind figures": summarize([o for o in sound if comparison_kind(o.case) == "allocated"]),
        "clarity clear": summarize([o for o in sound if o.case["clarity"] == "clear"]),
        "clear, allocated-kind": summarize([o for o in sound if o.case["clarity"] == "clear"
                                            and comparison_kind(o.case) == "allocated"]),
    }
    stamp = f"Run {time.strftime('%Y-%m-%d %H:%M %Z')}, trainmem commit {_commit()}, `python bench/published/run.py`."
    ranking = mechanism_ranking(outcomes)
    text = render(outcomes, summaries, ranking, stamp)
    print(text)
    if not args.only:
        RESULTS.mkdir(exist_ok=True)
        (RESULTS / "published.md").write_text(text)
        (RESULTS / "published.json").write_text(json.dumps({
            "schema": "trainmem.published-results/1", "stamp": stamp, "summaries": summaries,
            "mechanisms": [{"mechanism": m, "cases": n, "median_ratio": r} for m, n, r in ranking],
            "cases": [{"id": o.case["id"], "status": o.status, "reason": o.reason, "kind": comparison_kind(o.case),
                       "published_bytes": o.case["figure"]["bytes"], "trainmem_bytes": o.predicted_bytes,
                       "doubt": o.case.get("doubt", ""), "engine": o.case.get("engine", "estimate"),
                       "ratio": o.ratio, "clarity": o.case["clarity"], "unmodelled": o.case["unmodelled"]}
                      for o in outcomes]}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
