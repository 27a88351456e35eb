"""Float8 tensorwise + ``--compile`` per block + ``--recompute full`` (torchtitan's long-context rows):
estimate/compiled_float8_recompute.py against the compiled trace (``trace/compiled.py``: torchao's own
``Float8Linear`` in blocks compiled around their checkpoint, partitioned as inductor partitions them, run op by
op on fake tensors). Exact (==): the saved set and the backward's peak, to the byte. The trace side compiles each
case (10-30 s on 2 shared cores): slow. The fast tests pin the estimate to the traced integers. ``--recompute none``
(the blocks' own moments, estimate/compiled_float8_moment.py): the same checks, below ``NONE_CASES``.
"""

from __future__ import annotations

import pytest

from trainmem.errors import UnsupportedError
from trainmem.estimate import estimate
from trainmem.specs import ImplSpec, ParallelSpec, StepSpec
from trainmem.specs.loaders import spec_from_hf_config

# H 64, F 176, 4 heads of 16, 2 blocks, V 256 untied: every block linear converted (multiples of 16), the head not
LLAMA = dict(model_type="llama", hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=4, vocab_size=256, max_position_embeddings=256, tie_word_embeddings=False)
GQA = dict(LLAMA, num_key_value_heads=2)
WIDE = dict(LLAMA, hidden_size=128, intermediate_size=128, num_attention_heads=8, num_key_value_heads=2,
            num_hidden_layers=3)
WIDE_F = dict(WIDE, intermediate_size=256, num_hidden_layers=2)
SMALL_V = dict(GQA, vocab_size=128)  # --recompute none: the block's moment above the loss's on one device
FSDP2 = ParallelSpec(dp=2, fsdp="full")
# (config, precision, batch, seq): the moment each traced step's backward peaks at (module docstring)
CASES = {
    "cast": (LLAMA, "bf16", 2, 64),  # down_proj's weight-gradient cast of act(gate)·up
    "cast_fp32": (LLAMA, "fp32", 2, 64),
    "cast_gqa": (WIDE, "bf16", 2, 96),
    "silu": (GQA, "fp16", 2, 32),  # SiLU's fp32 backward
    "up_weight": (WIDE_F, "bf16", 1, 32),  # up_proj's weight cast in the recomputed forward
    # autocast: a fp32 residual stream (the norms' inputs, up_proj's input gradient cast back), bf16 linears
    "amp": (LLAMA, "amp-bf16", 2, 64),
    "amp_wide": (WIDE, "amp-bf16", 2, 96),
}
HOST_RNG = 5056  # per checkpointed block: the CPU generator state its SDPA replays, host memory (docs/compile.md)


def _impl(**kw) -> ImplSpec:
    return ImplSpec(**{**dict(device="cpu", attention="sdpa", compile=True, compile_scope="block", recompute="full",
                              float8="tensorwise", optimizer_impl="foreach"), **kw})


def _step(precision, batch, seq) -> StepSpec:
    return StepSpec(batch=batch, seq=seq, precision=precision, optimizer="adamw")


def _backward_peak(e) -> int:
    return max(sum(p.parts.values()) for p in e.phases if p.name.startswith("backward"))


def test_the_checkpointed_float8_block_backward_is_the_traced_moment_exact():
    # traced (slow test below): the step's peak, inside block 0's backward, at down_proj's weight-gradient
    # cast of the recomputed act(gate)·up (its fp32 copy and scaled product, 2·B·S·F·4), beside every fp8
    # weight the recomputed forward cast (q, k, v, o, gate, up: out·in + 4 B each) and the recomputed values
    e = estimate(spec_from_hf_config(LLAMA), _step("bf16", 2, 64), _impl())
    assert e.totals_bytes["activation"] == 246148 + 4 - 2 * HOST_RNG == 236040  # each block keeps its input
    assert e.peak_bytes == _backward_peak(e) == 1608040
    # without the moment the estimate read 1,334,464 B (the optimizer step; the block working set 1,208,682 B)
    assert _backward_peak(estimate(spec_from_hf_config(LLAMA), _step("fp32", 2, 64), _impl())) == 2828904
    assert _backward_peak(estimate(spec_from_hf_config(GQA), _step("fp16", 2, 32), _impl())) == 1232224
    assert _backward_peak(estimate(spec_from_hf_config(WIDE_F), _step("bf16", 1, 32), _impl())) == 2920552
    # amp-bf16: 2,196,088 B without the moment
    assert _backward_peak(estimate(spec_from_hf_config(LLAMA), _step("amp-bf16", 2, 64), _impl())) == 2645600


# rowwise + full (estimate/compiled_float8_rowwise_recompute.py): (config, precision, batch, seq, parallel) -> the
# traced backward peak (refused before; without the replay the bf16 case read 1,334,464 B: the optimizer step)
ROWWISE_FULL_CASES = {
    "bf16": ((LLAMA, "bf16", 2, 64, None, "rowwise", "full"), 1862476),  # up_proj's grad_output cast per row, block 0
    "bf16_s128": ((LLAMA, "bf16", 1, 128, None, "rowwise", "full"), 1866572),
    "gqa": ((GQA, "bf16", 2, 32, None, "rowwise", "full"), 1436236),
    "wide": ((WIDE, "bf16", 2, 96, None, "rowwise", "full"), 3995980),
    "few_tokens": ((WIDE_F, "bf16", 1, 32, None, "rowwise", "full"), 3559500),  # an mm's fp32 output scaling
    "fsdp": ((LLAMA, "fsdp-bf16", 2, 64, FSDP2, "rowwise", "full"), 2229964),
    "fsdp_few_tokens": ((WIDE_F, "fsdp-bf16", 1, 32, FSDP2, "rowwise", "full"), 4527948),
}


def _case_estimate(config, precision, batch, seq, parallel, recipe, recompute="none", gathered=False):
    """The estimate (its rank's, under ``parallel``) of a ``NONE_CASES`` / ``ROWWISE_FULL_CASES`` /
    ``GATHERED_CASES`` case (``gathered``: FSDP2's fp8 all-gather)."""
    impl = _impl(recompute=recompute, float8=recipe, float8_all_gather=gathered)
    e = estimate(spec_from_hf_config(config), _step(precision, batch, seq), impl,
                 **({"parallel": parallel} if parallel else {}))
    return e.ranks[0] if parallel else e


def _case_trace(config, precision, batch, seq, parallel, recipe, recompute="none", gathered=False):
    """The compiled fake trace of the same case (slow)."""
    pytest.importorskip("torchao.float8")
    from trainmem.trace import trace_step

    return trace_step(config, _step(precision, batch, seq),
                      _impl(recompute=recompute, float8=recipe, float8_all_gather=gathered),
                      **({"parallel": parallel} if parallel else {}))


def test_the_checkpointed_rowwise_block_backward_is_the_traced_moment_exact():
    # the replayed backward (down's input gradient, the recomputed forward holding every weight's abs and fp32 copy
    # for its input-gradient cast, the MLP's backward) at up_proj's grad_output cast per row in block 0
    e = _case_estimate(*ROWWISE_FULL_CASES["bf16"][0])
    assert e.totals_bytes["activation"] == 246148 + 4 - 2 * HOST_RNG  # each block keeps its input, as tensorwise
    assert e.peak_bytes == _backward_peak(e) == 1862476


@pytest.mark.parametrize("config,precision,kw,field", [
    (LLAMA, "fp16", dict(float8="rowwise"), "float8='rowwise'"),  # rowwise + full: bf16 only (ROWWISE_FULL_CASES)
    (LLAMA, "fp16", dict(float8="rowwise", recompute="op"), "float8='rowwise'"),  # rowwise + op: bf16 only too
    (dict(LLAMA, intermediate_size=168), "bf16", {}, "float8='tensorwise'"),  # F not a multiple of 16
    # rowwise at none outside bf16 (SMALL_V B 2 S 64 read 0.882 of the trace in fp16, 0.964 in fp32, 0.972 amp-bf16)
    *((SMALL_V, p, dict(float8="rowwise", recompute="none"), "float8='rowwise'") for p in ("fp16", "fp32", "amp-bf16")),
])
def test_unchecked_layouts_are_refused_by_name(config, precision, kw, field):
    with pytest.raises(UnsupportedError, match=field):
        estimate(spec_from_hf_config(config), _step(precision, 1, 16), _impl(**kw))


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(CASES))
def test_estimate_equals_the_float8_checkpointed_trace(case):
    pytest.importorskip("torchao.float8")
    from trainmem.trace import trace_step

    config, precision, batch, seq = CASES[case]
    step, impl = _step(precision, batch, seq), _impl()
    t = trace_step(config, step, impl)
    e = estimate(spec_from_hf_config(config), step, impl)
    blocks = config["num_hidden_layers"]
    # the saved set + the fp32 loss the caller holds (4 B) less the host-side generator states
    assert t.meta["compile"]["saved_compiled_bytes"] + 4 - blocks * HOST_RNG == e.totals_bytes["activation"]
    assert _backward_peak(e) == _trace_backward_peak(t)


@pytest.mark.slow
def test_estimate_equals_the_fsdp2_float8_checkpointed_trace():
    # FSDP2 (fake process group), fsdp-bf16, no fp8 all-gather: the block moment beside FSDP2's buffers
    # (estimate/fsdp_timeline.py: a Float8Linear's weight is a plain parameter without the fp8 all-gather)
    pytest.importorskip("torchao.float8")
    from trainmem.trace import trace_step

    step, impl, par = _step("fsdp-bf16", 2, 64), _impl(), ParallelSpec(dp=2, fsdp="full")
    t = trace_step(LLAMA, step, impl, parallel=par)
    (rank,) = estimate(spec_from_hf_config(LLAMA), step, impl, parallel=par).ranks
    assert t.meta["compile"]["saved_compiled_bytes"] + 4 - 2 * HOST_RNG == rank.totals_bytes["activation"]
    assert rank.peak_bytes == t.peak_logical_bytes == 1975528


def _trace_backward_peak(t) -> int:
    """The most logical bytes alive between the trace's backward mark and the next one."""
    rec, live, top, inside = t.recording, 0, 0, False
    marks = dict(rec.marks)
    for i, ev in enumerate(rec.events):
        if i in marks:
            inside = marks[i] == "backward"
        live += rec.blocks[ev].nbytes if ev >= 0 else -rec.blocks[~ev].nbytes
        if inside:
            top = max(top, live)
    return top


def test_the_fp8_all_gather_at_none_outside_fsdp_bf16_is_estimated():
    # amp-bf16's fp32 weights gathered in fp8: traced, the other precisions in test_float8_compiled_gathered_precisions.py
    assert _backward_peak(_case_estimate(LLAMA, "amp-bf16", 2, 64, FSDP2, "tensorwise", "none", True)) == 2115352


@pytest.mark.parametrize("kw", [{}, dict(float8_all_gather=True)])
def test_float8_per_pipeline_stage_under_fsdp2_is_refused_by_name(kw):
    # pipeline stages: not traced (trace --pp refuses Float8)
    with pytest.raises(UnsupportedError, match="compile: float8='tensorwise'.*pipeline stages"):
        estimate(spec_from_hf_config(LLAMA), _step("fsdp-bf16", 2, 64), _impl(recompute="none", **kw),
                 parallel=ParallelSpec(pp=2, dp=2, fsdp="full"))


@pytest.mark.parametrize("extra", [("--recompute", "full"), ("--recompute", "none", "--float8", "rowwise"),
                                   ("--recompute", "op", "--dp", "2", "--fsdp", "full", "--precision", "fsdp-bf16")])
def test_compiled_float8_per_pipeline_stage_is_refused_in_one_line(tmp_path, extra):
    # trace --pp refuses Float8, so no stage's compiled Float8 block is checked: refused (it was estimated unchecked)
    import json
    import subprocess
    import sys

    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(LLAMA))
    args = ["estimate", "--model", str(cfg), "--precision", "bf16", "--batch", "2", "--seq", "64", "--pp", "2",
            "--compile", "--compile-scope", "block", "--float8", "tensorwise", *extra]
    proc = subprocess.run([sys.executable, "-m", "trainmem.cli", *args], capture_output=True, text=True, timeout=120)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and proc.stdout == "", proc.stderr
    assert "compile: float8=" in lines[0] and "pipeline stages" in lines[0]


# --recompute none: (config, precision, batch, seq, parallel, recipe) -> the traced backward peak (slow test below)
NONE_CASES = {
    "fsdp_silu": ((LLAMA, "fsdp-bf16", 2, 64, FSDP2, "tensorwise"), 1920234),  # SiLU's backward, block 0 (0.945 before)
    "fsdp_gate_cast": ((WIDE_F, "fsdp-bf16", 1, 32, FSDP2, "tensorwise"), 3864432),  # gate_proj's weight cast, block 0
    "bf16_silu": ((SMALL_V, "bf16", 2, 64, None, "tensorwise"), 1430676),  # SiLU's, block 1 (1,271,324 before)
    "bf16_gate_cast": ((WIDE_F, "bf16", 1, 32, None, "tensorwise"), 2895984),
    "fp16": ((SMALL_V, "fp16", 2, 32, None, "tensorwise"), 1077610),
    "fp32": ((LLAMA, "fp32", 2, 64, None, "tensorwise"), 2903224),
    # autocast: a fp32 residual stream, the cache's roped k in fp32, fp32 weight gradients (0.972 and 0.877 before)
    "amp": ((SMALL_V, "amp-bf16", 2, 64, None, "tensorwise"), 2239660),
    "amp_fsdp": ((LLAMA, "amp-bf16", 2, 64, FSDP2, "tensorwise"), 2357804),
    # rowwise (estimate/compiled_float8_rowwise.py): up_proj's grad_output cast per row, block 1 (1,271,240 before)
    "rowwise_bf16": ((SMALL_V, "bf16", 2, 64, None, "rowwise"), 1441356),
    "rowwise_fsdp": ((LLAMA, "fsdp-bf16", 2, 64, FSDP2, "rowwise"), 1930956),  # block 0 (0.940 before)
    "rowwise_gate_dw": ((WIDE_F, "bf16", 1, 32, None, "rowwise"), 2957388),  # gate's weight gradient's output scaling
    "rowwise_fsdp_wide": ((WIDE_F, "fsdp-bf16", 1, 32, FSDP2, "rowwise"), 3925836),
}


def test_the_uncheckpointed_float8_block_backward_is_the_traced_moment_exact():
    # block 0's SiLU backward beside FSDP2's buffers (estimate/compiled_float8_moment.py): the residual gradient and
    # up_proj's input gradient (2 x B·S·H·2 = 2 x 16384), the gate's fp32 copy (B·S·F·4 = 90112), the recomputed
    # post-attention norm's fp32 input and normalized product and its output's fp8 cast (8192·(4 + 2 + 1) + 4 = 57348),
    # SiLU's three fp32 temporaries (3 x 90112) and the KV-cache tangents (2 x 16384); freed: the 16-bit gate and up
    # (2 x 45056), o_proj's output and the block's output (2 x 16384), down's and up's amax and inverse scale (2 x 6)
    e = _case_estimate(*NONE_CASES["fsdp_silu"][0])
    assert e.peak_bytes == _backward_peak(e) == 1920234  # the trace's peak (1,814,428 B without the moment)


# FSDP2's fp8 all-gather at --recompute none (estimate/compiled_float8_gathered.py: v's, gate's, up's and down's
# column-major fp8 weight copies saved, no amax; the moments without weight casts), fsdp-bf16 dp 2: the traced peak,
# each at block 0's SiLU backward (the bf16 case read 1,870,114 B without the copies: 0.992)
GATHERED_CASES = {
    "bf16": ((LLAMA, "fsdp-bf16", 2, 64, FSDP2, "tensorwise", "none", True), 1885464),
    "gqa": ((GQA, "fsdp-bf16", 2, 64, FSDP2, "tensorwise", "none", True), 1772824),
    "few_tokens": ((WIDE_F, "fsdp-bf16", 1, 32, FSDP2, "tensorwise", "none", True), 3622808),
    # block 1's moment: block 0's forward scales still its parameters' (the 0.992 estimate missed them too)
    "wide": ((WIDE, "fsdp-bf16", 2, 96, FSDP2, "tensorwise", "none", True), 4283372),
}

# the replayed and formula moments' cases, by name: each estimate's backward peak is the traced integer
REPLAYED = {**{f"none_{k}": v for k, v in NONE_CASES.items()},
            **{f"full_{k}": v for k, v in ROWWISE_FULL_CASES.items()},
            **{f"gathered_{k}": v for k, v in GATHERED_CASES.items()}}


def test_every_case_estimates_its_traced_backward_peak():
    for case, (args, traced) in REPLAYED.items():
        assert _backward_peak(_case_estimate(*args)) == traced, case


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(REPLAYED))
def test_estimate_equals_the_float8_trace(case):
    args, traced = REPLAYED[case]
    t, e = _case_trace(*args), _case_estimate(*args)
    assert _trace_backward_peak(t) == _backward_peak(e) == traced
    if case.startswith(("full", "gathered")):  # the saved set too: a checkpointed block adds a host generator state,
        # the fp8 all-gather its 7 forward scales (the parameters', not autograd's: compiled_float8_gathered.py)
        per_block = -HOST_RNG if case.startswith("full") else 7 * 4
        assert t.meta["compile"]["saved_compiled_bytes"] + 4 + args[0]["num_hidden_layers"] * per_block == \
            e.totals_bytes["activation"]


def _real_float8_step(config, step: StepSpec, impl: ImplSpec) -> tuple[int, int, int]:
    """(bytes autograd saves, the step's peak live bytes, Adam's host step counters' bytes) of the compiled
    checkpointed Float8 step on real CPU tensors (torch 2.13 runs ``_scaled_mm`` on the CPU), built as the tracer
    builds it (gradient checkpointing, torchao's conversion, each block compiled with the partitioning backend),
    after one warm-up step. Nothing of the tracer runs on these tensors."""
    import torch

    from trainmem.models.hf import build_hf_model
    from trainmem.trace.compiled import compile_model
    from trainmem.trace.float8 import convert_float8
    from trainmem.trace.optimizers import make_optimizer_for
    from trainmem.trace.recompute import enable_recompute
    from trainmem.trace.saved import saved_tensors, step_peak_bytes

    torch.manual_seed(0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        model = build_hf_model(config, attention=impl.attention).train()
    finally:
        torch.set_default_dtype(default)
    enable_recompute(model, impl)
    convert_float8(model, impl)
    compiled, _ = compile_model(model, impl)
    *_, opt = make_optimizer_for(model, step, impl)
    ids = torch.randint(0, config["vocab_size"], (step.batch, step.seq))

    def loss():
        return compiled(ids, labels=ids).loss

    def train_step():  # backward, then the optimizer's step and set_to_none
        loss().backward()
        opt.step(), opt.zero_grad(set_to_none=True)

    train_step()
    saved = saved_tensors(model, loss)[0]  # its output (the graph) dropped before the measured step
    return sum(t.nbytes for t in saved), step_peak_bytes(model, opt, train_step), 4 * len(opt.state)


@pytest.mark.slow
@pytest.mark.parametrize("recompute,recipe", [("full", "tensorwise"), ("op", "tensorwise"), ("none", "tensorwise"),
                                              ("none", "rowwise"), ("full", "rowwise")])  # op: tests/estimate/test_float8_compiled_op.py
def test_the_fake_trace_equals_the_real_compiled_float8_step(recompute, recipe):
    # the partitioned graphs on real CPU tensors (the backend without codegen: inductor's fusion would drop the
    # fp32 copies of the casts, docs/float8.md) against the fake trace the estimate is checked on; measured with
    # --recompute op: saved 401,884 B, peak 1,587,650 B by the live-storage meter; none (SMALL_V, the peak at block
    # 1's SiLU backward): saved 488,024 B, peak 1,429,736 B; rowwise (up's grad_output cast): 487,940 B, 1,440,416 B
    pytest.importorskip("torchao.float8")
    from trainmem.trace import trace_step

    config = SMALL_V if recompute == "none" else LLAMA
    step, impl = _step("bf16", 2, 64), _impl(recompute=recompute, float8=recipe)
    fake = trace_step(config, step, impl)
    saved, peak, host_steps = _real_float8_step(config, step, impl)
    assert fake.meta["compile"]["saved_compiled_bytes"] == saved
    # the trace counts the token ids (B·S·8 B), the live meter Adam's host step counters
    assert fake.peak_logical_bytes - 2 * 64 * 8 + host_steps == peak
