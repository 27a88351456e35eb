"""``estimate --compile --dp N --fsdp hybrid --fsdp-group G``: compiled blocks under HSDP (estimate/compiled_sharded.py).

HSDP is ``fully_shard`` on a ``(dp_replicate, dp_shard)`` mesh (trace/parallel_2d.py): sharded over the G ranks
of a group, the sharded gradient all-reduced in place across the replicas, so a rank allocates what FSDP2
over G ranks allocates. FSDP2's hooks stay ``_dynamo_disable``-d on the 2-D mesh, so each compiled block reads
the unsharded parameters and keeps the one-device compiled saved set, as under full sharding.

Exact (==): HSDP dp 4 over groups of 2 gives every ledger and the peak of FSDP2 over dp 2. Against the real
``fully_shard`` on a 2-D fake mesh with per-block ``torch.compile`` (slow): parameters, gradients, AdamW
states and the saved set to the byte; the step peak's estimate/trace ratio as measured (the FSDP2 compiled
trace reads the same peaks: HSDP's trace allocates exactly what FSDP2's over the shard group does).
"""

from __future__ import annotations

import pytest

from trainmem.cli import main
from trainmem.estimate import estimate
from trainmem.specs import ImplSpec, ParallelSpec, StepSpec
from trainmem.specs.loaders import spec_from_hf_config

LLAMA = dict(model_type="llama", hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=256, max_position_embeddings=256, tie_word_embeddings=False)
HSDP = ParallelSpec(dp=4, fsdp="hybrid", fsdp_group=2)
FSDP2 = ParallelSpec(dp=2, fsdp="full")  # full sharding over HSDP's shard group


def _impl(recompute="none"):
    return ImplSpec(device="cpu", attention="sdpa", compile=True, compile_scope="block", recompute=recompute)


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fsdp-bf16"])
@pytest.mark.parametrize("recompute", ["none", "full"])
def test_a_hybrid_rank_is_an_fsdp2_rank_over_its_shard_group(precision, recompute):
    model = spec_from_hf_config(LLAMA)
    step = StepSpec(batch=2, seq=64, precision=precision, optimizer="adamw")
    (hybrid,) = estimate(model, step, _impl(recompute), parallel=HSDP).ranks
    (full,) = estimate(model, step, _impl(recompute), parallel=FSDP2).ranks
    assert hybrid.totals_bytes == full.totals_bytes
    assert hybrid.peak_bytes == full.peak_bytes
    assert {i.name: i.bytes for i in hybrid.inventory} == {i.name: i.bytes for i in full.inventory}


def test_cli_estimates_compiled_hsdp(capsys, tmp_path):
    import json

    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(LLAMA))
    rc = main(["estimate", "--model", str(cfg), "--seq", "64", "--device", "cpu", "--compile", "--compile-scope",
               "block", "--dp", "4", "--fsdp", "hybrid", "--fsdp-group", "2", "--json"])
    out, err = capsys.readouterr()
    assert rc == 0, err
    assert json.loads(out)["ranks"][0]["peak_bytes"] > 0


# estimate == trace step peak (logical bytes), as under FSDP2 over dp 2 (test_compiled_fsdp.py), whose trace reads
# the same peaks. fp32 + full recompute: the checkpointed compiled block's backward moment
# (estimate/compiled_recompute.py; 2,246,344 B both, 0.9279 before it was modelled); fp32 without recompute: the
# compiled block's own backward moments on FSDP2's timeline (fsdp_timeline.block_moments, b46fac9; 0.9812 before)
CASES = [("fp32", "none"), ("fsdp-bf16", "none"), ("fp32", "full")]


@pytest.mark.slow  # one 2-D FSDP2 trace with compiled blocks each, ~30-40 s on 2 shared cores
@pytest.mark.parametrize("precision,recompute", CASES)
def test_estimate_equals_the_hsdp_compiled_trace(precision, recompute):
    from trainmem.trace import trace_step

    step = StepSpec(batch=2, seq=64, precision=precision, optimizer="adamw")
    traced = trace_step(LLAMA, step, _impl(recompute), parallel=HSDP)
    assert traced.meta["mesh"]["shape"] == [2, 2] and traced.meta["fsdp"]["sharding"] == "hybrid"
    (rank,) = estimate(spec_from_hf_config(LLAMA), step, _impl(recompute), parallel=HSDP).ranks
    states = ("parameter", "gradient", "optimizer_state")
    traced_states = {c: sum(it.bytes for it in traced.items if it.category.value == c) for c in states}
    assert traced_states == {c: rank.totals_bytes[c] for c in states}
    # the saved set autograd holds + the fp32 loss the caller holds (4 B); a checkpointed compiled block also
    # saves the CPU generator state its SDPA replays, 5056 B of host memory per block, not in the estimate
    host_rng_states = 2 * 5056 if recompute == "full" else 0
    assert traced.meta["compile"]["saved_compiled_bytes"] + 4 - host_rng_states == rank.totals_bytes["activation"]
    assert rank.peak_bytes == traced.peak_logical_bytes
