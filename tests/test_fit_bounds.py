"""The two bounds of a largest-value search (sweep, serve): the largest value that fits and the
largest that runs only by flushing the allocator cache (trainmem.fits.FIT_STATES;
measure.sweeps.bisect_max_runs).

Mistral-7B, bf16 AdamW (foreach), S=1024 on H100-80GB (usable 84,379,959,296 B reserved): B=4 fits,
B=5 runs with one cache flush per step, B=6 does not run (tests/integrations/test_batch_flush.py
has the bytes); over the sequence at B=1 the bisection finds S=4352 and, with the flush, S=5248.
"""

import json

import pytest

from trainmem.cli import main
from trainmem.measure.sweeps import bisect_max, bisect_max_runs, sweep
from trainmem.plan.hardware import load_gpu
from trainmem.specs import ImplSpec, StepSpec
from trainmem.specs.loaders import load_model

H100 = load_gpu("H100-80GB")
USABLE = H100.memory_bytes - H100.context_bytes


def _states(fits_upto: int, runs_upto: int, seen: list):
    def state(v: int) -> str:
        seen.append(v)
        return "fits" if v <= fits_upto else "fits_with_cache_flush" if v <= runs_upto else "does_not_fit"
    return state


@pytest.mark.parametrize("fits_upto, runs_upto, stop, want", [
    (40, 40, 1000, (40, False)),   # two states: the bounds are equal
    (40, 57, 1000, (57, False)),
    (0, 9, 1000, (9, False)),      # nothing fits, 1..9 run
    (0, 0, 1000, (None, False)),
    (40, 5000, 1000, (1000, True)),
    (1000, 5000, 1000, (1000, True)),  # capped by the strict search already
])
def test_bisect_max_runs(fits_upto, runs_upto, stop, want):
    seen: list = []
    state = _states(fits_upto, runs_upto, seen)
    strict, capped = bisect_max(lambda v: state(v) == "fits", start=1, stop=stop, multiple=1)
    assert (strict, capped) == ((fits_upto or None) if fits_upto < stop else stop, fits_upto >= stop)
    n = len(seen)
    assert bisect_max_runs(state, strict, capped, stop=stop, multiple=1) == want
    if runs_upto == fits_upto:  # the next value was evaluated by bisect_max: one lookup, no new value
        assert set(seen[n:]) <= set(seen[:n])


def test_bisect_max_runs_keeps_the_multiple():
    seen: list = []
    state = _states(4352, 5312, seen)
    strict, capped = bisect_max(lambda v: state(v) == "fits", start=1024, stop=32768, multiple=64)
    assert (strict, bisect_max_runs(state, strict, capped, stop=32768, multiple=64)) == (4352, (5312, False))


@pytest.fixture(scope="module")
def mistral():
    return load_model("mistral-7b")


def test_sweep_estimate_backend_reports_both_bounds(mistral):
    r = sweep(mistral, StepSpec(batch=1, seq=1024, precision="bf16"), ImplSpec(), over="batch", budget_bytes=USABLE,
              fit_reserved=True)
    assert (r.max_fit, r.max_fit_with_flush, r.capped_with_flush) == (4, 5, False)
    states = {p.value: p.fit_state for p in r.points}
    assert (states[4], states[5], states[6]) == ("fits", "fits_with_cache_flush", "does_not_fit")
    d = r.to_dict()
    assert (d["max_fit"], d["max_fit_with_flush"]) == (4, 5)
    # an allocated budget decides in two states: the bounds are equal
    r = sweep(mistral, StepSpec(batch=1, seq=1024, precision="bf16"), ImplSpec(), over="batch", budget_bytes=USABLE)
    assert r.max_fit == r.max_fit_with_flush and not any(p.fit_state == "fits_with_cache_flush" for p in r.points)


@pytest.mark.slow  # two sweeps through the CLI: ~2 s idle, 5 s on the loaded machine
def test_sweep_cli_gpu_json_validates_and_text_says_both(capsys):
    from trainmem.schemas import schema_path
    jsonschema = pytest.importorskip("jsonschema")
    argv = ["sweep", "--model", "mistral-7b", "--over", "batch", "--seq", "1024", "--precision", "bf16",
            "--gpu", "H100-80GB"]
    assert main([*argv, "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert not list(jsonschema.Draft202012Validator(json.loads(schema_path("sweep").read_text())).iter_errors(d))
    assert (d["max_fit"], d["max_fit_with_flush"]) == (4, 5)
    assert d["fits"]["fit_state"] == "fits" and d["fits_next"]["fit_state"] == "fits_with_cache_flush"
    assert "fits_with_flush" not in d  # B=5 is the next value tried: its verdict is fits_next
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "largest batch that runs only by flushing the allocator cache: 5 sequences" in out
    assert "batch=5: FITS ONLY BY FLUSHING THE ALLOCATOR CACHE on 1× H100-80GB" in out


def test_serve_largest_reports_both_bounds(mistral):
    from trainmem.serve.api import _largest
    step = StepSpec(batch=1, seq=1024, precision="bf16")
    got = _largest("batch", mistral, step, ImplSpec(), None, None, USABLE)
    assert got == {"value": 4, "capped": False, "value_with_flush": 5, "capped_with_flush": False, "why": ""}


@pytest.mark.slow  # the sequence search: ~30 estimates of Mistral-7B
def test_serve_largest_seq_reports_both_bounds(mistral):
    from trainmem.serve.api import _largest
    step = StepSpec(batch=1, seq=1024, precision="bf16")
    got = _largest("seq", mistral, step, ImplSpec(), None, None, USABLE)
    assert (got["value"], got["value_with_flush"]) == (4352, 5248)  # 5312 before the cuBLAS workspaces (7a97d99)


@pytest.mark.slow  # about 15 estimates of Llama-3-8B through the CLI
def test_sweep_gives_the_verdict_at_the_flush_bound_past_the_next_value(capsys):
    """Llama-3-8B bf16 on H100-80GB over the sequence: S=640 fits, S=704 (the next value tried) runs
    only with a flush, and so does everything up to S=4352 (docs/fits.md, `sweep --gpu`)."""
    argv = ["sweep", "--model", "llama-3-8b", "--over", "seq", "--gpu", "H100-80GB"]
    assert main([*argv, "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert (d["max_fit"], d["max_fit_with_flush"]) == (640, 4352)
    assert [d[k]["fit_state"] for k in ("fits", "fits_next", "fits_with_flush")] == [
        "fits", "fits_with_cache_flush", "fits_with_cache_flush"]
    assert d["fits_with_flush"]["allocated_bytes"] == next(p["peak_bytes"] for p in d["points"] if p["value"] == 4352)
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "largest seq that runs only by flushing the allocator cache: 4352 tokens" in out
    assert "seq=4352: FITS ONLY BY FLUSHING THE ALLOCATOR CACHE on 1× H100-80GB" in out
