"""parse_size, the growth-law fits and the bisection: pure functions, exact numbers."""

import math

import pytest

from trainmem.errors import SpecError
from trainmem.measure import fit as F
from trainmem.measure.sweeps import bisect_max
from trainmem.measure.units import parse_size


@pytest.mark.parametrize("text,expected", [
    ("80GiB", 80 * 2**30),          # 85899345920
    ("512MiB", 512 * 2**20),
    ("1.5 GiB", 3 * 2**29),
    ("80GB", 80 * 10**9),
    ("4096B", 4096),
    ("2t", 2 * 2**40),
    (1024, 1024),
])
def test_parse_size(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("bad", ["80XB", "", "GiB", "-1GiB", "0", "1e-9", "5e", "80", "1e9"])
def test_parse_size_rejects(bad):
    with pytest.raises(SpecError) as e:
        parse_size(bad)
    assert "budget=" in str(e.value)


def test_loglog_slope_exact():
    xs = [128, 256, 512, 1024]
    assert F.loglog_slope(xs, [3 * x for x in xs]) == pytest.approx(1.0)
    assert F.loglog_slope(xs, [5 * x * x for x in xs]) == pytest.approx(2.0)
    assert F.loglog_slope(xs, [7, 7, 7, 7]) == pytest.approx(0.0)
    assert F.loglog_slope(xs, [0, 0, 0, 0]) is None


def test_quadratic_fit_recovers_coefficients():
    xs = [128, 256, 384, 512, 1024]
    a, b, c = F.quadratic_fit(xs, [6144 * x * x + 7_362_324 * x + 1000 for x in xs])
    assert a == pytest.approx(6144, rel=1e-6)
    assert b == pytest.approx(7_362_324, rel=1e-6)
    assert c == pytest.approx(1000, abs=1e-2 * 7_362_324)
    # two points: a line
    assert F.quadratic_fit([1, 2], [3, 5]) == pytest.approx((0.0, 2.0, 1.0))


def test_verdict_threshold_and_crossover():
    # y = x² + 1000·x over [10, 100]: the quadratic share stays below 10 %
    xs = [10, 20, 40, 80, 100]
    f = F.fit_growth(xs, [x * x + 1000 * x for x in xs])
    assert F.verdict(f) == "linear"
    # over [10k, 100k] it is above 90 %
    xs = [10_000 * k for k in (1, 2, 4, 8, 10)]
    f = F.fit_growth(xs, [x * x + 1000 * x for x in xs])
    assert F.verdict(f) == "quadratic"
    assert F.crossover(f.quadratic_coef, f.linear_coef, 100_000) == pytest.approx(1000, rel=1e-3)
    assert F.crossover(0.0, 5.0, 1000) is None
    assert F.crossover(1e-12, 5.0, 1000) is None  # not significant


def test_bisect_max_exact():
    calls = []

    def fits(v):
        calls.append(v)
        return v <= 1000

    assert bisect_max(fits, start=128, stop=1 << 20, multiple=64) == (960, False)  # 15·64
    assert len(calls) < 12
    assert bisect_max(lambda v: v <= 100, start=128, stop=4096, multiple=64) == (64, False)
    assert bisect_max(lambda v: False, start=128, stop=4096, multiple=64) == (None, False)
    assert bisect_max(lambda v: True, start=1, stop=100, multiple=1) == (100, True)
    with pytest.raises(SpecError):
        bisect_max(lambda v: True, start=128, stop=32, multiple=64)
    assert math.isfinite(F.GrowthFit(1.0, 0, 1, 0, 2).to_dict()["exponent"])


def test_a_size_without_unit_is_refused_in_one_line(capsys):
    """``--budget 80`` was 80 bytes with exit 0 (issue 15, item 8)."""
    from trainmem.cli import main

    assert main(["sweep", "--model", "gpt2", "--over", "seq", "--budget", "80", "--backend", "estimate"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "budget='80'" in err[0] and "80GiB" in err[0] and "80GB" in err[0]


def test_describe_size_states_the_rule():
    from trainmem.units import describe_size

    assert describe_size("80GB") == "80GB = 80,000,000,000 bytes = 74.51 GiB"
    assert describe_size("80G") == "80G = 85,899,345,920 bytes = 80.00 GiB"
