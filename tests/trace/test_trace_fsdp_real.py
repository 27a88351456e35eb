"""``trace --dp 2 --fsdp full`` (FSDP2 on fake tensors, rank 0 of a fake process group) against a
real 2-rank gloo FSDP2 step (trainmem.measure_dist: torchrun, the tiny 4-block Llama fully_shard-ed
per block and at the root, foreach AdamW, the third step measured by the live-storage tracker).

Measured (fp32 and bf16 MixedPrecisionPolicy, blocks kept gathered from forward to backward, so
the real root, given ``reshard_after_forward=False`` explicitly, and the trace's root, left to
FSDP2's default, both stay gathered): the sharded ledgers equal, and the step peak equals the
trace's plus 156 B: AdamW's 39 step counters, 0-dim fp32 tensors on the CPU device there, which
the trace keeps on the host as on CUDA (adam.py: ``step`` is a host tensor unless capturable/fused).
"""

from __future__ import annotations

import collections
import functools

import pytest

torch = pytest.importorskip("torch")
if not torch.distributed.is_available() or not torch.distributed.is_gloo_available():
    pytest.skip("torch.distributed with gloo is not available", allow_module_level=True)

from trainmem.measure_dist.launch import run_torchrun_many  # noqa: E402
from trainmem.measure_dist.worker import DEFAULTS  # noqa: E402
from trainmem.specs import ImplSpec, ParallelSpec, StepSpec  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.distributed]  # torchrun, 2 ranks: ~1 min on 2 shared cores

CONFIG = DEFAULTS["config"]
IMPL = ImplSpec(device="cpu", attention="sdpa", optimizer_impl="foreach")  # the worker steps foreach AdamW
MP = {"fp32": None, "fsdp-bf16": "bf16"}


@functools.lru_cache(maxsize=None)
def _real() -> dict[str, list[dict]]:
    scenarios = [dict(strategy="fsdp", reshard_after_forward=False, mp_param_dtype=mp, tracked_repeats=3)
                 for mp in MP.values()]
    return dict(zip(MP, run_torchrun_many(2, scenarios, timeout=400)))


@pytest.mark.parametrize("precision", list(MP))
def test_trace_equals_a_real_fsdp2_step(precision):
    from trainmem.trace import trace_step

    traced = trace_step(CONFIG, StepSpec(batch=DEFAULTS["batch"], seq=DEFAULTS["seq"], precision=precision,
                                         optimizer="adamw"), IMPL,
                        parallel=ParallelSpec(dp=2, fsdp="full", reshard_after_forward=False))
    ledgers: dict[str, int] = collections.defaultdict(int)
    for it in traced.items:
        ledgers[it.category.value] += it.bytes
    counters = 4 * (CONFIG["num_hidden_layers"] * 9 + 3)  # 9 weights per block, embedding, norm, head
    for r in _real()[precision]:
        assert {k: r["states_bytes"][k] for k in ("parameter", "gradient", "optimizer_state")} == {
            k: ledgers[k] for k in ("parameter", "gradient", "optimizer_state")}
        assert r["states_bytes"]["optimizer_step"] == counters == 156
        # the least of four tracked steps: gloo's worker thread may hold a finished collective's buffers a
        # moment past FSDP2's last reference, which only adds bytes (test_trace_pp_real.py)
        assert min(r["peak_bytes"], *r["op_boundary_peaks_bytes"]) == traced.peak_logical_bytes + counters, (
            r["peak_bytes"], r["op_boundary_peaks_bytes"])
        if r["peak_bytes"] == traced.peak_logical_bytes + counters:  # step 3 not perturbed: its peak op
            assert r["peak_op"] == f"aten.{traced.peak_op}.default"
