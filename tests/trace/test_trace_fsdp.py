"""``trace --dp N --fsdp full``: the real FSDP2 (``fully_shard``) step on fake tensors, as rank 0 of N
in torch's fake process group (trace/parallel_fsdp.py), against the estimate.

Exact (==): the parameter, gradient and optimizer-state ledgers (this rank's shards); the forward
and optimizer phases' FSDP part (the difference trace - estimate is the one-device difference,
to the byte), resharded or kept (docs/trace.md "FSDP2 in the trace").
The step peak, eager, recompute none: exact (==), resharded or kept (the loss's padded labels and a middle
block's moments since estimate/fsdp_timeline.py ``middle_blocks``; tests/estimate/test_fsdp_peak_middle.py
checks 3 and 4 blocks and ``--recompute full``, tests/estimate/test_fsdp_gaps.py the FSDP2 part at each moment).
"""

from __future__ import annotations

import collections

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from trainmem.cli import main  # noqa: E402
from trainmem.estimate import estimate  # noqa: E402
from trainmem.specs import ImplSpec, ParallelSpec, StepSpec  # noqa: E402
from trainmem.specs.loaders import spec_from_hf_config  # noqa: E402

LLAMA = dict(model_type="llama", hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=256, max_position_embeddings=256, tie_word_embeddings=False)
GPT2 = dict(model_type="gpt2", n_embd=64, n_layer=2, n_head=4, vocab_size=256, n_positions=256,
            attn_pdrop=0.0, embd_pdrop=0.0, resid_pdrop=0.0)
IMPL = ImplSpec(device="cpu", attention="sdpa")
# Llama: a block holds q, o 64x64, k, v 32x64, gate, up, down 3x64x176 and two norms of 64
BLOCK = 2 * 64 * 64 + 2 * 32 * 64 + 3 * 64 * 176 + 2 * 64  # 46,208 parameters
ROOT = 2 * 256 * 64 + 64  # embedding, untied head, final norm: 32,832


def _cli(capsys, *argv):
    rc = main(["trace", "--model", "llama-3-8b", "--seq", "16", *argv])
    out, err = capsys.readouterr()
    return rc, out, err


@pytest.mark.parametrize("argv,flag", [
    (["--dp", "2", "--fsdp", "full", "--tp", "2", "--cp", "2"], "--cp 2"),  # TP + FSDP2: tests/trace/test_trace_2d.py
    (["--dp", "2", "--fsdp", "hybrid", "--pp", "2", "--microbatches", "2"], "--fsdp hybrid"),  # FSDP2 under PP:
    # tests/trace/test_trace_pp.py
    (["--dp", "2", "--fsdp", "full", "--zero", "3"], "--zero 3"),
    (["--dp", "4", "--fsdp", "hybrid", "--fsdp-group", "3"], "fsdp_group=3"),  # HSDP: tests/trace/test_trace_hsdp.py
    (["--dp", "2", "--fsdp", "hybrid", "--fsdp-version", "1"], "--fsdp-version 1"),
    (["--dp", "2", "--fsdp", "full", "--fsdp-version", "1", "--no-reshard-after-forward"], "--fsdp-version 1"),
    (["--dp", "2", "--fsdp", "full", "--offload", "params"], "--offload params"),
    (["--fsdp", "full"], "dp=1"), (["--dp", "1", "--fsdp", "full"], "dp=1"),
    (["--dp", "2"], "--dp 2"),  # DDP is not traced
])
def test_what_fsdp_trace_cannot_run_is_one_line(capsys, argv, flag):
    rc, out, err = _cli(capsys, *argv)
    assert rc == 2 and out == ""
    assert err.count("\n") == 1 and flag in err


def _phase_max(result) -> dict[str, int]:
    """The most logical bytes alive in each recorded phase of the traced step, and (``loss``) after
    the loss's forward (the estimate's ``forward`` phase is that moment: the end of forward)."""
    rec = result.recording
    marks, live, phase = dict(rec.marks), 0, None
    top: dict[str, int] = collections.defaultdict(int)
    for i, e in enumerate(rec.events):
        phase = marks.get(i, phase)
        b = rec.blocks[e if e >= 0 else ~e]
        live += b.nbytes if e >= 0 else -b.nbytes
        if i >= rec.baseline:
            top[phase] = max(top[phase], live)
            if e >= 0 and phase == "forward" and b.op == "nll_loss_forward":
                top["loss"] = live
    return top


def _ledgers(result) -> dict[str, int]:
    out: dict[str, int] = collections.defaultdict(int)
    for it in result.items:
        out[it.category.value] += it.bytes
    return out


def _both(cfg, precision, par):
    from trainmem.trace import trace_step

    step = StepSpec(batch=2, seq=64, precision=precision, optimizer="adamw")
    est = estimate(spec_from_hf_config(cfg), step, IMPL, parallel=par)
    return trace_step(cfg, step, IMPL, parallel=par), est


@pytest.fixture(scope="module")
def one_device():
    """trace - estimate per phase on one device (the same step without FSDP): forward, optimizer."""
    from trainmem.trace import trace_step

    out = {}
    for name, cfg in (("llama", LLAMA), ("gpt2", GPT2)):
        for precision in ("fp32", "bf16"):
            step = StepSpec(batch=2, seq=64, precision=precision, optimizer="adamw")
            est = {p.name: p.bytes for p in estimate(spec_from_hf_config(cfg), step, IMPL).phases}
            top = _phase_max(trace_step(cfg, step, IMPL))
            assert top["loss"] == top["forward"]  # one device: the forward's top is the loss
            out[name, precision] = {"loss": top["loss"] - est["forward"], "optimizer": top["optimizer"] - est["optimizer"]}
    return out


CASES = [(name, cfg, precision, n, reshard) for name, cfg in (("llama", LLAMA), ("gpt2", GPT2))
         for precision in ("fp32", "fsdp-bf16") for n in (2, 4) for reshard in (True, False)]


@pytest.mark.slow  # ~3 s per case on 2 shared cores (FSDP2's lazy init, two steps on fake tensors)
@pytest.mark.parametrize("name,cfg,precision,n,reshard", CASES,
                         ids=[f"{c[0]}-{c[2]}-fsdp{c[3]}-{'reshard' if c[4] else 'keep'}" for c in CASES])
def test_fsdp_trace_against_the_estimate(one_device, name, cfg, precision, n, reshard):
    from trainmem.estimate.fsdp_streams import fsdp_groups

    traced, whole = _both(cfg, precision, ParallelSpec(dp=n, fsdp="full", reshard_after_forward=reshard))
    (est,) = whole.ranks
    assert traced.meta["fsdp"]["world_size"] == n
    got = _ledgers(traced)
    for ledger in ("parameter", "gradient", "optimizer_state"):
        assert got[ledger] == est.totals_bytes[ledger], ledger
    if name == "llama":  # fp32 shards: rank 0 holds 1/n of every parameter (every dim 0 divides by 4)
        assert got["parameter"] == got["gradient"] == (2 * BLOCK + ROOT) // n * 4
        assert got["optimizer_state"] == 2 * got["parameter"]  # AdamW's exp_avg, exp_avg_sq
    top = _phase_max(traced)
    phases = {p.name: p for p in est.phases}
    single = one_device[name, "fp32" if precision == "fp32" else "bf16"]  # fsdp-bf16 computes as bf16 does
    assert top["optimizer"] - phases["optimizer"].bytes == single["optimizer"]
    # resharded or kept, the forward holds the last block's flat all-gather output until the root's
    # post-forward (after HF's loss): estimated since estimate/fsdp_timeline.py
    assert top["loss"] - phases["forward"].bytes - single["loss"] == 0
    last = fsdp_groups(whole)[-1]
    assert last.name == "layers.1" and phases["forward"].parts["fsdp_allgather"] == last.output_bytes
    # inside the last block's forward its parameters and their flat all-gather output are both alive;
    # on GPT-2 fp32 (hidden 64, V 256: a small loss) that moment tops the loss's, by 16,616 B
    assert top["forward"] >= top["loss"]
    assert est.peak_bytes == traced.peak_logical_bytes


@pytest.mark.slow
def test_gathered_parameters_are_followed_and_the_group_is_gone():
    """Each block's parameters are gathered twice when resharded after forward (forward and
    backward), once when kept; the root's once; the fake process group is destroyed after."""
    import torch.distributed as dist

    for reshard, times in ((True, 2), (False, 1)):
        traced, _ = _both(LLAMA, "fp32", ParallelSpec(dp=2, fsdp="full", reshard_after_forward=reshard))
        assert not dist.is_initialized()
        gathers = collections.Counter(b.name for b in traced.recording.blocks if b.origin == "fsdp_unsharded")
        assert gathers["model.layers.0.mlp.up_proj.weight.unsharded"] == times
        assert gathers["lm_head.weight.unsharded"] == 1
        # the unsharded weight is whole (176 x 64 fp32) on rank 0
        up = next(b for b in traced.recording.blocks if b.name == "model.layers.0.mlp.up_proj.weight.unsharded")
        assert up.nbytes == 176 * 64 * 4


@pytest.mark.slow
def test_a_process_group_already_there_is_refused():
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from trainmem.errors import UnsupportedError
    from trainmem.trace import trace_step

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        with pytest.raises(UnsupportedError, match="already initialised"):
            trace_step(LLAMA, StepSpec(batch=1, seq=16), IMPL, parallel=ParallelSpec(dp=2, fsdp="full"))
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.parametrize("cfg", [LLAMA, GPT2], ids=["llama", "gpt2-tied"])
def test_embedding_and_head_as_their_own_units(cfg):
    """``--fsdp-units blocks+embed+head`` (torchtitan's apply_fsdp; a tied output layer joins the
    embedding's unit): the sharded ledgers equal the estimate's; the peak within 3% (measured
    Llama 1.030, GPT-2 0.992: the estimate's forward phase holds two of the largest unit gathered at
    the end of forward, where the trace has none of the blocks)."""
    traced, whole = _both(cfg, "fp32", ParallelSpec(dp=2, fsdp="full", fsdp_units="blocks+embed+head"))
    (est,) = whole.ranks
    assert traced.meta["fsdp"]["units"] == 2 + 2 + 1  # two blocks, embedding, norm + head, root
    got = _ledgers(traced)
    for ledger in ("parameter", "gradient", "optimizer_state"):
        assert got[ledger] == est.totals_bytes[ledger], ledger
    assert 0.97 <= est.peak_bytes / traced.peak_logical_bytes <= 1.035


@pytest.mark.slow
def test_float8_all_gather_gathers_fp8_weights():
    """``--float8 tensorwise --float8-all-gather``: torchao's ``enable_fsdp_float8_all_gather`` under the
    FSDP2 trace. Each converted weight's shard is cast to fp8 before the all-gather, so a block's flat
    all-gather output is its 46,080 linear weights in 1 byte plus its two norms in bf16 (46,336 B, the
    estimate's ``fsdp_allgather``); the sharded ledgers equal the estimate's; fake == real CPU tensors
    (the same FSDP2 and torchao code under the fake process group) to the byte; the peak (at the loss's
    backward) is the estimate's plus torchao's fp8 scales (4 B each: the 7 weights' of both blocks
    saved for backward, 7 alive; the one-device 1,024 B of nll_loss's released target is gone since 5d50412)."""
    from trainmem.trace import trace_step

    step = StepSpec(batch=2, seq=64, precision="fsdp-bf16", optimizer="adamw")
    impl = ImplSpec(device="cpu", attention="sdpa", float8="tensorwise", float8_all_gather=True)
    par = ParallelSpec(dp=2, fsdp="full")
    traced = trace_step(LLAMA, step, impl, parallel=par)
    (est,) = estimate(spec_from_hf_config(LLAMA), step, impl, parallel=par).ranks
    got = _ledgers(traced)
    for ledger in ("parameter", "gradient", "optimizer_state"):
        assert got[ledger] == est.totals_bytes[ledger], ledger
    gathered = {b.name: b for b in traced.recording.blocks if b.origin == "fsdp_unsharded"}
    up = gathered["model.layers.0.mlp.up_proj.weight.unsharded"]
    assert (up.dtype, up.nbytes) == ("float8_e4m3fn", 176 * 64)
    assert gathered["model.layers.0.input_layernorm.weight.unsharded"].dtype == "bfloat16"
    assert gathered["lm_head.weight.unsharded"].dtype == "bfloat16"  # the head is not converted
    flat = [b.nbytes for b in traced.recording.blocks if b.module == "model.layers.0" and b.op == "empty"]
    fwd = {p.name: p.parts for p in est.phases}["forward"]
    assert fwd["fsdp_allgather"] == 46080 + 2 * 64 * 2 == 46336 and 46336 in flat
    assert trace_step(LLAMA, step, impl, parallel=par, real=True).peak_logical_bytes == traced.peak_logical_bytes
    assert est.peak_bytes - traced.peak_logical_bytes == -(14 + 7) * 4


@pytest.mark.slow
def test_cli_traces_fsdp_and_float8_flags(tmp_path, capsys):
    """The trace command passes --float8/--float8-all-gather through (it dropped them before) and
    prints what the FSDP trace ran; --json's figures are trace_step's."""
    import json

    from trainmem.trace import trace_step

    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(LLAMA))
    argv = ["trace", "--model", str(cfg), "--batch", "2", "--seq", "64", "--device", "cpu", "--dp", "2", "--fsdp",
            "full", "--precision", "fsdp-bf16", "--float8", "tensorwise", "--float8-all-gather"]
    assert main([*argv, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    impl = ImplSpec(device="cpu", float8="tensorwise", float8_all_gather=True)
    traced = trace_step(LLAMA, StepSpec(batch=2, seq=64, precision="fsdp-bf16"), impl,
                        parallel=ParallelSpec(dp=2, fsdp="full"))
    assert out["peak_logical_bytes"] == traced.peak_logical_bytes
    assert out["meta"]["fsdp"]["world_size"] == 2 and len(out["meta"]["float8"]["converted"]) == 14
    assert main(argv) == 0
    assert "FSDP2: rank 0 of 2 (torch's fake process group), 3 fully_shard units" in capsys.readouterr().out


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["fp32", "fsdp-bf16"])
def test_fsdp1_flat_parameters(precision):
    """``--fsdp-version 1``: FullyShardedDataParallel (use_orig_params, one unit per block and the
    root, FULL_SHARD) under the fake process group. The sharded ledgers (flat-parameter chunks, their
    reduce-scattered gradients, AdamW's states on the views) equal the estimate's
    (estimate/fsdp1_flat.py); fake == real CPU tensors to the byte; the peak as FSDP2's (measured
    estimate/trace 1.028 fp32, 1.0005 fsdp-bf16)."""
    from trainmem.trace import trace_step

    par = ParallelSpec(dp=2, fsdp="full", fsdp_version=1)
    traced, whole = _both(LLAMA, precision, par)
    (est,) = whole.ranks
    got = _ledgers(traced)
    for ledger in ("parameter", "gradient", "optimizer_state"):
        assert got[ledger] == est.totals_bytes[ledger], ledger
    flats = [b for b in traced.recording.blocks if b.origin == "fsdp_unsharded"]
    gathered = 2 if precision == "fsdp-bf16" else 4
    # one padded flat parameter per unit, gathered whole (46,208 divides by 2: no padding)
    assert {b.nbytes for b in flats if b.name == "model.layers.0.flat_param_full_param_padded.unsharded"} == {
        BLOCK * gathered}
    real = trace_step(LLAMA, StepSpec(batch=2, seq=64, precision=precision, optimizer="adamw"), IMPL, parallel=par,
                      real=True)
    assert real.peak_logical_bytes == traced.peak_logical_bytes
    assert 0.97 <= est.peak_bytes / traced.peak_logical_bytes <= 1.03


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["fp32", "fsdp-bf16"])
def test_side_streams_have_their_own_pools(precision):
    """FSDP2 enters its all-gather copy-in and reduce-scatter streams with ``torch.cpu.stream`` on CPU,
    so the recorder tags each allocation with the stream current then, and the trace's reserved figure
    replays them through per-stream pools (trace/allocator.py), as the estimate's pooled replay
    (estimate/fsdp_streams.py): the copy-in stream holds every all-gather (root and 2 blocks in
    forward, the 2 resharded blocks again in backward; with bf16, each with its cast input too), the
    reduce-scatter stream one output per unit. Measured reserved trace / estimate: 1.010 fp32 and 1.011
    fsdp-bf16 here (the 4-block Llama: 0.992 and 0.989; one pool there: 0.60 and 0.51)."""
    from trainmem.estimate.allocation_order import estimate_reserved
    from trainmem.trace.allocator import replay

    traced, whole = _both(LLAMA, precision, ParallelSpec(dp=2, fsdp="full"))
    streams = collections.Counter(b.stream for b in traced.recording.blocks)
    assert streams[1] == (3 + 2) * (2 if precision == "fsdp-bf16" else 1)
    assert streams[2] == 3  # layers.0, layers.1, root
    rec = traced.recording
    one_pool = replay([("alloc", e, rec.blocks[e].nbytes) if e >= 0 else ("free", ~e) for e in rec.events])
    assert one_pool.reserved_peak_bytes < traced.peak_reserved_bytes
    ratio = traced.peak_reserved_bytes / estimate_reserved(whole).reserved_bytes
    assert 0.97 <= ratio <= 1.03, ratio
