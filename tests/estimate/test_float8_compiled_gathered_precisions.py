"""FSDP2's fp8 all-gather at ``--recompute none`` under ``--compile`` per block outside fsdp-bf16 (``--precision bf16``,
``fp16``: the parameters themselves in 16 bits, no MixedPrecisionPolicy; ``fp32``; ``amp-bf16``: fp32 weights under
autocast): estimate/compiled_float8_gathered.py (the saved column-major fp8 weight copies, torch 2.13's static indices)
and compiled_float8_moment.py (the MLP's moments without weight casts; the attention's input gradients summed beside
every weight gradient of the block) against the compiled trace under FSDP2 on the fake process group. Exact (==): the
saved set (+ each block's 7 forward scales, the parameters', not autograd's) and the backward's peak, to the byte.
Refused before (only fsdp-bf16 was traced). With few tokens beside fp32 weight gradients (H 128 F 256 B 1 S 32) the
attention's moment is the step's peak: without it the estimate read 4,010,904 B of 4,096,256 traced (0.979) in fp32,
3,988,376 of 4,104,448 (0.972) in amp-bf16. The checkpointed blocks (``--recompute full`` and ``op``:
compiled_float8_recompute.py, compiled_float8_op.py ``gathered_scales``) read the compiled set without checkpointing,
so the lift reaches them too: checked below (``CHECKPOINTED``), in bf16, fp16, fp32 and amp-bf16. With fp32 weights and
few tokens the checkpointed block peaks at the attention's moment too (compiled_float8_recompute.py, with its recomputed
rsqrt): refused before, when its moments lacked it (H 128 F 256 B 1 S 32 fp32 op read 3,998,616 B of 4,096,256 traced,
0.976; S 16 0.951; amp-bf16 full 0.967, S 16 0.943).
"""

from __future__ import annotations

import pytest
from test_float8_compiled_recompute import FSDP2, GQA, HOST_RNG, LLAMA, WIDE, WIDE_F, _backward_peak, _case_estimate
from test_float8_compiled_recompute import _case_trace, _trace_backward_peak

from trainmem.specs import ParallelSpec

_16 = {"llama": (662136, 1463184), "gqa": (625272, 1377168), "few_tokens": (414976, 2170136),
       "wide": (1544624, 3168652)}  # bf16 and fp16 read the same bytes
# (precision, shape) -> (the estimate's activations, the traced backward peak); shapes: (config, batch, seq)
SHAPES = {"llama": (LLAMA, 2, 64), "gqa": (GQA, 2, 64), "few_tokens": (WIDE_F, 1, 32), "wide": (WIDE, 2, 96),
          "fewer_tokens": (WIDE_F, 1, 16), "wide_few_tokens": (WIDE, 1, 32)}
CASES = {
    **{("bf16", k): v for k, v in _16.items()}, **{("fp16", k): v for k, v in _16.items()},
    ("fp32", "llama"): (1075832, 2399832), ("fp32", "gqa"): (1006200, 2240088),
    ("fp32", "few_tokens"): (572672, 4096256),  # q's input gradient summed, block 0
    ("fp32", "fewer_tokens"): (388800, 4046912), ("fp32", "wide"): (2607536, 5374472),
    ("amp-bf16", "llama"): (748152, 2115352), ("amp-bf16", "gqa"): (711288, 1994520),
    ("amp-bf16", "few_tokens"): (507136, 4104448),  # q's weight gradient cast from its bf16 mm output, block 0
    ("amp-bf16", "fewer_tokens"): (388800, 4067392), ("amp-bf16", "wide"): (1812912, 4811244),
    ("amp-bf16", "wide_few_tokens"): (492088, 3727444),
}


def _args(precision: str, shape: str) -> tuple:
    config, batch, seq = SHAPES[shape]
    return config, precision, batch, seq, FSDP2, "tensorwise", "none", True


def test_every_case_estimates_its_traced_backward_peak():
    for (precision, shape), expected in CASES.items():
        e = _case_estimate(*_args(precision, shape))
        assert (e.totals_bytes["activation"], _backward_peak(e)) == expected, (precision, shape)


def test_the_16_bit_parameters_save_what_fsdp_bf16_saves():
    # the same block set as fsdp-bf16's gathered one (GATHERED_CASES): 16-bit activations, fp8 weight copies for v,
    # gate, up and down, each weight's inverse scale and forward scale
    e = _case_estimate(*_args("bf16", "llama"))
    mp = _case_estimate(LLAMA, "fsdp-bf16", 2, 64, FSDP2, "tensorwise", "none", True)
    assert e.totals_bytes["activation"] == mp.totals_bytes["activation"] == 662136


def test_the_attention_moment_with_few_tokens_beside_fp32_weight_gradients():
    # H 128 F 256 B 1 S 32 fp32, block 0: every weight gradient of the block but the input norm's (4 x (3 x 256 x 128 +
    # 2 x 128 x 128 + 2 x 32 x 128 + 128) = 557,568 B), the residual gradient, the normalized product, k's and v's
    # input gradients summed, q's and the sum (5 x 32 x 128 x 4 = 81,920 B): the traced peak, 85,352 B above the MLP's
    e = _case_estimate(*_args("fp32", "few_tokens"))
    assert e.peak_bytes == _backward_peak(e) == 4010904 + 85352 == 4096256


@pytest.mark.slow  # 21 FSDP2 compiled traces on the fake process group, 7-50 s each on 2 shared cores
@pytest.mark.parametrize("precision,shape", sorted(CASES))
def test_estimate_equals_the_gathered_trace(precision, shape):
    saved, traced = CASES[precision, shape]
    t, e = _case_trace(*_args(precision, shape)), _case_estimate(*_args(precision, shape))
    blocks = SHAPES[shape][0]["num_hidden_layers"]
    assert t.meta["compile"]["saved_compiled_bytes"] + 4 + blocks * 7 * 4 == saved == e.totals_bytes["activation"]
    assert _trace_backward_peak(t) == _backward_peak(e) == traced


# --recompute full and op with the fp8 all-gather in bf16/fp16 (torchtitan's FSDP + compile + Float8 rows without a
# MixedPrecisionPolicy): (config, precision, batch, seq, recompute) -> (the estimate's activations, the traced backward
# peak); fp16 reads bf16's bytes
CHECKPOINTED = {
    "llama_full": ((LLAMA, "bf16", 2, 64, "full"), 236096, 1335264),
    "llama_op": ((LLAMA, "bf16", 2, 64, "op"), 391804, 1335264),
    "llama_op_fp16": ((LLAMA, "fp16", 2, 64, "op"), 391804, 1335264),
    "gqa_full": ((GQA, "bf16", 2, 64, "full"), 236096, 1277920),
    "gqa_op": ((GQA, "bf16", 2, 64, "op"), 375420, 1277920),
    "wide_full": ((WIDE, "bf16", 2, 96, "full"), 550748, 2773072),  # block 1's moment, three blocks
    "wide_op": ((WIDE, "bf16", 2, 96, "op"), 882614, 2883694),
    "few_tokens_full": ((WIDE_F, "bf16", 1, 32, "full"), 84680, 2153752),
    "few_tokens_op": ((WIDE_F, "bf16", 1, 32, "op"), 137988, 2153752),
    "few_tokens_op_fp16": ((WIDE_F, "fp16", 1, 32, "op"), 137988, 2153752),
}


def _checkpointed(config, precision, batch, seq, recompute) -> tuple:
    return config, precision, batch, seq, FSDP2, "tensorwise", recompute, True


# fp32 weights (fp32; amp-bf16: fp32 weights under autocast, op's kept mm outputs in bf16): (precision, shape,
# recompute) -> (the estimate's activations, the traced backward peak); refused before
FP32_WEIGHTS = {
    ("fp32", "llama", "full"): (305728, 2272032), ("fp32", "llama", "op"): (617096, 2272032),
    ("fp32", "gqa", "full"): (305728, 2161440), ("fp32", "gqa", "op"): (584328, 2161440),
    ("fp32", "wide", "full"): (802652, 4807640), ("fp32", "wide", "op"): (1466312, 5028860),
    # the attention's moment, block 0 (3,998,616 / 3,850,392 / 3,591,092 B without it)
    ("fp32", "few_tokens", "full"): (119496, 4096256), ("fp32", "few_tokens", "op"): (226064, 4096256),
    ("fp32", "fewer_tokens", "full"): (59784, 4046912), ("fp32", "fewer_tokens", "op"): (113104, 4046912),
    ("fp32", "wide_few_tokens", "full"): (135908, 3688732), ("fp32", "wide_few_tokens", "op"): (246608, 3688732),
    ("amp-bf16", "llama", "full"): (322112, 2099992), ("amp-bf16", "gqa", "full"): (322112, 2005784),
    ("amp-bf16", "wide", "full"): (819036, 4570064),
    # q's weight gradient cast from its bf16 mm output, block 0 (3,969,944 / 3,836,056 / 3,562,420 B without it)
    ("amp-bf16", "few_tokens", "full"): (176840, 4104448), ("amp-bf16", "fewer_tokens", "full"): (121224, 4067392),
    ("amp-bf16", "wide_few_tokens", "full"): (193252, 3696924),
    ("amp-bf16", "llama", "op"): (477820, 2099992), ("amp-bf16", "gqa", "op"): (461436, 2005784),
    ("amp-bf16", "wide", "op"): (1150902, 4680686), ("amp-bf16", "few_tokens", "op"): (230148, 4104448),
    ("amp-bf16", "fewer_tokens", "op"): (147908, 4067392), ("amp-bf16", "wide_few_tokens", "op"): (248638, 3696924),
}
CHECKPOINTED.update({f"{shape}_{recompute}_{p}": ((SHAPES[shape][0], p, *SHAPES[shape][1:], recompute), *v)
                     for (p, shape, recompute), v in FP32_WEIGHTS.items()})


def test_the_checkpointed_attention_moment_with_few_tokens_beside_fp32_weight_gradients():
    # H 128 F 256 B 1 S 32 fp32 op, block 0, as without checkpointing (test above): every weight gradient of the block
    # but the input norm's (557,568 B), the residual gradient, the recomputed normalized product, k's and v's input
    # gradients summed, q's and the sum (5 x 32 x 128 x 4 = 81,920 B), and the recomputed rsqrt (32 x 4 = 128 B): the
    # traced peak, 97,640 B above the MLP's moments
    e = _case_estimate(*_checkpointed(WIDE_F, "fp32", 1, 32, "op"))
    assert e.peak_bytes == _backward_peak(e) == 3998616 + 97640 == 4096256


def test_the_checkpointed_cases_estimate_their_traced_backward_peak():
    for case, (args, saved, traced) in CHECKPOINTED.items():
        e = _case_estimate(*_checkpointed(*args))
        assert (e.totals_bytes["activation"], _backward_peak(e)) == (saved, traced), case


@pytest.mark.slow  # 34 FSDP2 compiled traces on the fake process group, 5-35 s each
@pytest.mark.parametrize("case", sorted(CHECKPOINTED))
def test_the_checkpointed_estimate_equals_the_gathered_trace(case):
    args, saved, traced = CHECKPOINTED[case]
    t, e = _case_trace(*_checkpointed(*args)), _case_estimate(*_checkpointed(*args))
    # the saved set less each checkpointed block's host generator state, plus (op) the kept mms' forward scales,
    # alive as the parameters' (compiled_float8_op.py gathered_scales)
    params = sum(i.bytes for i in e.inventory if i.name.endswith(".param_scale"))
    rng = args[0]["num_hidden_layers"] * HOST_RNG
    assert t.meta["compile"]["saved_compiled_bytes"] + 4 - rng + params == saved == e.totals_bytes["activation"]
    assert _trace_backward_peak(t) == _backward_peak(e) == traced


# the checkpointed attention moment under other FSDP2 layouts (H 128 F 256): (precision, batch, seq, parallel,
# recompute) -> (the estimate's activations, the traced backward peak)
LAYOUTS = {
    "dp4_fp32_full": (("fp32", 1, 32, ParallelSpec(dp=4, fsdp="full"), "full"), 119496, 2922624),
    "no_reshard_fp32_op": (("fp32", 1, 32, ParallelSpec(dp=2, fsdp="full", reshard_after_forward=False), "op"),
                           226064, 4096256),
    "dp4_amp_full_s64": (("amp-bf16", 1, 64, ParallelSpec(dp=4, fsdp="full"), "full"), 288072, 3064088),
    "b2_fp32_op": (("fp32", 2, 32, FSDP2, "op"), 447880, 4290968),
}


def _layout(precision, batch, seq, parallel, recompute) -> tuple:
    return WIDE_F, precision, batch, seq, parallel, "tensorwise", recompute, True


def test_the_other_layouts_estimate_their_traced_backward_peak():
    for case, (args, saved, traced) in LAYOUTS.items():
        e = _case_estimate(*_layout(*args))
        assert (e.totals_bytes["activation"], _backward_peak(e)) == (saved, traced), case


@pytest.mark.slow  # four FSDP2 compiled traces on the fake process group, 10-20 s each
@pytest.mark.parametrize("case", sorted(LAYOUTS))
def test_the_other_layouts_equal_the_gathered_trace(case):
    args, saved, traced = LAYOUTS[case]
    t, e = _case_trace(*_layout(*args)), _case_estimate(*_layout(*args))
    params = sum(i.bytes for i in e.inventory if i.name.endswith(".param_scale"))
    assert t.meta["compile"]["saved_compiled_bytes"] + 4 - 2 * HOST_RNG + params == saved == e.totals_bytes["activation"]
    assert _trace_backward_peak(t) == _backward_peak(e) == traced
