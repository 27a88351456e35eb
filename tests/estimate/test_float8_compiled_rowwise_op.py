"""Float8 rowwise + ``--compile`` per block + ``--recompute op`` (torchtitan's Float8 rowwise rows with selective op
AC): estimate/compiled_float8_op.py (the saved per-row inverse scales) and compiled_float8_rowwise_op.py (the
backward replayed allocation by allocation) against the compiled trace (torchao's ``Float8Linear`` in blocks compiled
around torchtitan's op policy, partitioned as inductor partitions them, run op by op on fake tensors; the fake trace ==
the real compiled CPU step, slow test below). Exact (==): the saved set and the backward's peak, to the byte.
Before: refused ("op around rowwise: not traced"); the checkpointed block's replay (compiled_float8_rowwise_recompute.py)
read 1,879,884 B for the first case, 1.077 of the trace.
"""

from __future__ import annotations

import pytest
from test_compiled_op_cuda import cpu_sdpa_saved  # noqa: F401  (a fixture; same directory: rootdir import mode)
from test_float8_compiled_recompute import FSDP2, GQA, HOST_RNG, LLAMA, SMALL_V, WIDE, WIDE_F, _backward_peak
from test_float8_compiled_recompute import _case_estimate, _case_trace, _impl, _real_float8_step, _step
from test_float8_compiled_recompute import _trace_backward_peak

from trainmem.estimate import estimate
from trainmem.specs.loaders import spec_from_hf_config

# name -> ((config, precision, batch, seq, parallel, recipe, recompute), the estimate's activations (the trace's saved
# set + the fp32 loss, less the recomputed CPU SDPA's host generator states), the traced backward peak)
CASES = {
    "bf16": ((LLAMA, "bf16", 2, 64, None, "rowwise", "op"), 393736, 1745740),  # up's grad_output cast per row, block 0
    "bf16_s128": ((LLAMA, "bf16", 1, 128, None, "rowwise", "op"), 397840, 1749836),
    "gqa": ((GQA, "bf16", 2, 32, None, "rowwise", "op"), 188680, 1331788),
    "wide": ((WIDE, "bf16", 2, 96, None, "rowwise", "op"), 887048, 3774796),
    "few_tokens": ((WIDE_F, "bf16", 1, 32, None, "rowwise", "op"), 138384, 3240012),
    "small_v": ((SMALL_V, "bf16", 2, 64, None, "rowwise", "op"), 311816, 1545036),
    "fsdp": ((LLAMA, "fsdp-bf16", 2, 64, FSDP2, "rowwise", "op"), 393736, 2113228),
    "fsdp_few_tokens": ((WIDE_F, "fsdp-bf16", 1, 32, FSDP2, "rowwise", "op"), 138384, 4208460),
}


def _block(e, i=0) -> dict[str, int]:
    return {n.name.split(f"layers.{i}.")[1]: n.bytes for n in e.inventory
            if n.category.value == "activation" and f"layers.{i}." in n.name}


def test_the_policy_keeps_q_v_gate_and_two_row_scales():
    # q, v and the gate (the 1st, 3rd and 5th mm, as without Float8) and the q/k/v and gate/up input casts' inverse
    # scales per row (B·S x 4 = 512 B each, the first reader's mm kept, a later one recomputed); no amax (aten.amax is
    # not on the policy's list); the block's output is the next block's kept input
    e = _case_estimate(*CASES["bf16"][0])
    assert _block(e) == {"self_attn.q_proj.out": 16384, "self_attn.v_proj.out": 16384, "mlp.gate_proj.out": 45056,
                         "self_attn.q_proj.input_scale_inv": 2 * 64 * 4, "mlp.gate_proj.input_scale_inv": 2 * 64 * 4,
                         "residual_mlp": 16384}
    # tensorwise's op set (401,884 B saved) less its 44 B of scalars per block, plus 2 x 512 B per block
    assert e.totals_bytes["activation"] == 401884 - 2 * 44 + 2 * 1024 + 4 - 2 * HOST_RNG == 393736


def test_every_case_estimates_its_traced_backward_peak():
    for case, (args, saved, traced) in CASES.items():
        e = _case_estimate(*args)
        assert (e.totals_bytes["activation"], _backward_peak(e)) == (saved, traced), case


@pytest.mark.slow  # eight compiled traces, 8-30 s each on 2 shared cores
@pytest.mark.parametrize("case", sorted(CASES))
def test_estimate_equals_the_rowwise_op_trace(case):
    args, saved, traced = CASES[case]
    t, e = _case_trace(*args), _case_estimate(*args)
    assert t.meta["compile"]["saved_compiled_bytes"] + 4 - args[0]["num_hidden_layers"] * HOST_RNG == saved == \
        e.totals_bytes["activation"]
    assert _trace_backward_peak(t) == _backward_peak(e) == traced


# the CPU SDPA kernel on the policy's list standing in for CUDA's flash kernel: its output and log-sum-exp kept, o_proj
# recomputed from them, the attention's recompute deferred to its backward (no host generator state)
CUDA_CASES = {
    "bf16": ((LLAMA, "bf16", 2, 64, None, "rowwise", "op"), 430600, 1668684),  # up's grad_output cast, block 1
    "bf16_s128": ((LLAMA, "bf16", 1, 128, None, "rowwise", "op"), 434704, 1672780),
    "gqa": ((GQA, "bf16", 2, 32, None, "rowwise", "op"), 207112, 1290828),
    "wide": ((WIDE, "bf16", 2, 96, None, "rowwise", "op"), 1052936, 3662156),
    "few_tokens": ((WIDE_F, "bf16", 1, 32, None, "rowwise", "op"), 156816, 3188812),
    "fsdp": ((LLAMA, "fsdp-bf16", 2, 64, FSDP2, "rowwise", "op"), 430600, 2023116),
}


def test_the_cuda_kernels_keep_the_sdpa_output_and_defer_the_attention():
    # CUDA's flash kernel is on the policy's list: its output and log-sum-exp kept (16384 + 2048 B per block), the
    # MLP's moments hold no input norm, k weight cast or attention recompute, and the block input stays for it
    e = estimate(spec_from_hf_config(LLAMA), _step("bf16", 2, 64), _impl(device="cuda", recompute="op", float8="rowwise"))
    cpu = _case_estimate(*CASES["bf16"][0])
    assert e.totals_bytes["activation"] - cpu.totals_bytes["activation"] == 2 * (16384 + 2048)
    assert _backward_peak(e) == 1668684  # the CPU kernel standing in (slow test below)


@pytest.mark.slow  # six compiled traces with the CPU SDPA kernel on the policy's list, 8-25 s each
@pytest.mark.parametrize("case", sorted(CUDA_CASES))
def test_the_cuda_stand_in_equals_the_trace(cpu_sdpa_saved, case):  # noqa: F811
    args, saved, traced = CUDA_CASES[case]
    t, e = _case_trace(*args), _case_estimate(*args)
    assert t.meta["compile"]["saved_compiled_bytes"] + 4 == saved == e.totals_bytes["activation"]
    assert _trace_backward_peak(t) == _backward_peak(e) == traced


@pytest.mark.slow  # a compiled fake trace and a real compiled CPU step, ~40 s
def test_the_fake_trace_equals_the_real_compiled_rowwise_op_step():
    # the partitioned graphs on real CPU tensors (the backend without codegen) against the fake trace the estimate
    # is checked on: the saved set, and the peak but for the token ids (the trace's) and Adam's host step counters
    pytest.importorskip("torchao.float8")
    (config, precision, batch, seq, _, recipe, recompute), *_ = CASES["bf16"]
    fake = _case_trace(config, precision, batch, seq, None, recipe, recompute)
    saved, peak, host_steps = _real_float8_step(config, _step(precision, batch, seq),
                                                _impl(recompute=recompute, float8=recipe))
    assert fake.meta["compile"]["saved_compiled_bytes"] == saved
    assert fake.peak_logical_bytes - batch * seq * 8 + host_steps == peak
