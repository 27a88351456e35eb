"""The FSDP2 estimate per tensor (estimate/fsdp_timeline.py) against real gloo FSDP2 steps
(trainmem.measure_dist: torchrun, the tiny 4-block Llama, fp32, each block ``fully_shard``-ed and the
root left to FSDP2's default as torchtitan's ``apply_fsdp``; the launches tests/parallel/parallel_runs.py
shares with test_vs_estimate.py).

Exact: the estimate's peak is the real one less AdamW's 39 step counters (0-dim fp32 tensors on the
CPU device in the real run, 156 B, which the estimate keeps on the host as on CUDA); kept gathered (the
peak at the loss's forward) HF's padded labels (1,040 B) are counted there since estimate/forward_held.py
runs under FSDP2 too. Measured also with fsdp-bf16 (docs/parallel.md "FSDP2 per tensor at each phase").
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
if not torch.distributed.is_available() or not torch.distributed.is_gloo_available():
    pytest.skip("torch.distributed with gloo is not available", allow_module_level=True)

from parallel_runs import B, CONFIG, S, measured  # noqa: E402
from trainmem.estimate import estimate  # noqa: E402
from trainmem.specs import ImplSpec, ParallelSpec, StepSpec  # noqa: E402
from trainmem.specs.loaders import spec_from_hf_config  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.distributed]  # the shared launches: ~2-4 min on 2 shared cores

STEP_COUNTERS = 39 * 4  # AdamW's step, one 0-dim fp32 tensor per parameter


@pytest.mark.parametrize("name", ["fsdp2-reshard", "fsdp2-keep", "fsdp4-reshard", "fsdp4-keep"])
def test_peak_is_the_real_one_to_the_byte(name):
    world, reshard = int(name[4]), name.endswith("reshard")
    est = estimate(spec_from_hf_config(CONFIG), StepSpec(batch=B, seq=S, precision="fp32", optimizer="adamw"),
                   ImplSpec(device="cpu", attention="sdpa", optimizer_impl="foreach"),
                   parallel=ParallelSpec(dp=world, fsdp="full", reshard_after_forward=reshard))
    (rank,) = est.ranks
    assert rank.peak.name == ("backward" if reshard else "forward")
    for r in measured(name):
        assert rank.peak_bytes == r["peak_bytes"] - STEP_COUNTERS, r["rank"]
