"""Paged bitsandbytes optimizers in the step-time model: their states' PCIe traffic, per trainable
parameter as many bytes as the estimate pages (estimate/state_items.py), out and back each step."""

from __future__ import annotations

import pytest

from trainmem.estimate.state_items import optimizer_state_items
from trainmem.inventory import Category
from trainmem.plan.cost import matmul_parameters, step_time
from trainmem.plan.hardware import GPU
from trainmem.specs import ImplSpec, ParallelSpec, StepSpec
from trainmem.specs.loaders import load_model

GPU1 = GPU(name="x", memory_bytes=1 << 36, bf16_flops=1e15, intra_node_bytes_per_s=1e11,
           inter_node_bytes_per_s=1e10, host_bytes_per_s=1e10, gpus_per_node=8)
MODEL = load_model("llama-3-8b")
PAGED = {"paged-adamw8bit": 2, "paged-adamw32bit": 8, "paged-lion8bit": 1, "paged-lion32bit": 4}


@pytest.mark.parametrize("opt,per_param", PAGED.items())
def test_paged_bytes_per_parameter_are_the_estimates(opt, per_param):
    # a tensor of 1e5 values is paged whole: uint8 or fp32 state1 (and state2 for Adam)
    step = StepSpec(batch=1, seq=16, optimizer=opt)
    items = optimizer_state_items("w", (100_000,), step)
    assert sum(it.bytes for it in items if it.category == Category.PAGED_STATE) == per_param * 100_000


@pytest.mark.parametrize("opt,per_param", PAGED.items())
def test_plan_charges_paged_states_out_and_back(opt, per_param):
    _, n_all = matmul_parameters(MODEL)
    times = {o: step_time(MODEL, StepSpec(batch=1, seq=2048, optimizer=o), ImplSpec(attention="flash"),
                          ParallelSpec(), GPU1, global_batch=4) for o in (opt, "adamw")}
    # 2 (out and back) · N · bytes per parameter / host bandwidth
    assert times[opt].offload_s - times["adamw"].offload_s == pytest.approx(2 * n_all * per_param / 1e10)
    assert times["adamw"].offload_s == 0


def test_zero1_divides_the_paged_traffic_by_dp():
    _, n_all = matmul_parameters(MODEL)
    t = step_time(MODEL, StepSpec(batch=1, seq=2048, optimizer="paged-lion32bit"), ImplSpec(attention="flash"),
                  ParallelSpec(dp=4, zero=1), GPU1, global_batch=4)
    assert t.offload_s == pytest.approx(2 * n_all / 4 * 4 / 1e10)  # each rank pages its quarter
