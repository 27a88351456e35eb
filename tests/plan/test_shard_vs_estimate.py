"""The planner's fast path (plan/shard.py) against ``estimate(..., parallel=...)`` under TP, PP,
ZeRO/FSDP and SP.

* Model states: exact. Both shard each state by the estimator's own TP/EP divisor
  (``estimate/parallel_tp.py`` ``_tp_factor`` over the family registry's TP roles: norms and routers
  replicated, column/row/vocab-parallel weights ÷ tp, DTensor's replicated embedding gradient,
  the tied head's copy on the last PP stage) and then by ZeRO stage (``apply_zero``). The fast path
  does it over per-role totals, the estimator per tensor, so the two could differ by the per-item
  padding ceilings; at these shapes every shard divides evenly and the bytes are equal.
* The peak: a lower bound. The fast path leaves out the communication buffers (TP/DP all-gather
  and reduce-scatter, NCCL buckets, FSDP's root unsharded), the loss-parallel temporaries and
  the PP output chunks the estimator adds on top; the planner's screen relies on it never
  exceeding the estimator's allocated peak (plan/search.py: it must drop no configuration the
  estimator fits).
"""

from __future__ import annotations

import pytest

from trainmem.estimate import estimate
from trainmem.inventory import Category
from trainmem.plan.ranks import stage_peaks
from trainmem.specs import ImplSpec, ParallelSpec, StepSpec
from trainmem.specs.loaders import load_model

STEP = StepSpec(batch=1, seq=1024, precision="mixed-bf16")
IMPL = ImplSpec(attention="flash")
STATES = {"parameters": Category.PARAMETER, "master_weights": Category.MASTER_WEIGHT,
          "optimizer_states": Category.OPTIMIZER_STATE}
LAYOUTS = [ParallelSpec(tp=2), ParallelSpec(tp=4, sp=True, dp=2, zero=1),
           ParallelSpec(tp=2, pp=2, microbatches=4, dp=2, zero=2), ParallelSpec(tp=2, sp=True, dp=2, fsdp="full")]


@pytest.fixture(scope="module", params=["gpt2", "llama-3-8b",  # tied and biased; untied, GQA
                                        pytest.param("mixtral-8x7b", marks=pytest.mark.slow)])  # experts: ~1 s each
def model(request):
    return load_model(request.param)


@pytest.mark.parametrize("par", LAYOUTS, ids=lambda p: f"tp{p.tp}{'sp' if p.sp else ''}-pp{p.pp}-dp{p.dp}-"
                                                       f"{'fsdp' if p.fsdp else f'zero{p.zero}'}")
def test_fast_path_states_equal_the_estimators_and_its_peak_bounds_it_below(model, par):
    e = estimate(model, STEP, IMPL, parallel=par)
    fast = stage_peaks(model, STEP, IMPL, par)
    ranks = [e.ranks[0], e.ranks[-1]] if par.pp > 1 else list(e.ranks)
    assert len(fast) == len(ranks)
    for stage, rank in zip(fast, ranks):
        for part, category in STATES.items():
            assert stage.parts.get(part, 0) == sum(i.bytes for i in rank.inventory if i.category is category), part
    assert max(s.peak_bytes for s in fast) <= e.peak_bytes
