"""The step-time model's arithmetic on configurations small enough to write out."""

from __future__ import annotations

import pytest

from trainmem.plan.cost import CostModel, matmul_parameters, step_time
from trainmem.plan.hardware import GPU
from trainmem.specs import ImplSpec, ParallelSpec, StepSpec
from trainmem.specs.loaders import load_model

GPU1 = GPU(name="x", memory_bytes=1 << 36, bf16_flops=1e15, intra_node_bytes_per_s=1e11,
           inter_node_bytes_per_s=1e10, host_bytes_per_s=1e10, gpus_per_node=8)
MODEL = load_model("llama-3-8b")  # untied: the input embedding does no matmul


def test_matmul_parameters_leave_out_the_input_embedding():
    active, total = matmul_parameters(MODEL)
    assert total - active == MODEL.vocab_size * MODEL.hidden_size


def test_compute_time_is_flops_over_rate():
    step = StepSpec(batch=1, seq=2048)
    N, _ = matmul_parameters(MODEL)
    t = step_time(MODEL, step, ImplSpec(attention="flash"), ParallelSpec(), GPU1, global_batch=4,
                  cost=CostModel(mfu=0.5))
    tokens = 4 * 2048
    # 6·N per token + causal attention 3 · 4·L·S·(A·hd) / 2 per token
    flops = 6 * N * tokens + 3 * 4 * 32 * 2048 * 4096 // 2 * tokens
    assert t.compute_s == pytest.approx(flops / (1e15 * 0.5))
    assert t.tp_s == t.cp_s == t.pp_s == t.bubble_s == t.dp_exposed_s == t.offload_s == 0


def test_full_recompute_adds_one_forward_and_pipeline_adds_a_bubble():
    step = StepSpec(batch=1, seq=2048)
    base = step_time(MODEL, step, ImplSpec(attention="flash"), ParallelSpec(), GPU1, global_batch=8)
    full = step_time(MODEL, step, ImplSpec(attention="flash", recompute="full"), ParallelSpec(), GPU1, global_batch=8)
    assert full.compute_s == pytest.approx(base.compute_s * 4 / 3)
    pp = step_time(MODEL, step, ImplSpec(attention="flash"), ParallelSpec(pp=4, microbatches=8), GPU1, global_batch=8)
    # 1F1B: (pp - 1) / m = 3/8 of the pipelined time
    assert pp.bubble_s == pytest.approx((pp.compute_s + pp.pp_s) * 3 / 8)


def test_tensor_parallel_traffic():
    step = StepSpec(batch=1, seq=2048)
    t = step_time(MODEL, step, ImplSpec(attention="flash"), ParallelSpec(tp=4, sp=True), GPU1, global_batch=1)
    # 4 all-reduces of B·S·H·2 bytes per block, ring 2·(t-1)/t, 32 blocks, intra-node
    assert t.tp_s == pytest.approx(32 * 4 * 2 * 3 / 4 * 2048 * 4096 * 2 / 1e11)


def test_bad_mfu():
    from trainmem.errors import SpecError
    with pytest.raises(SpecError, match="mfu"):
        CostModel(mfu=0)
