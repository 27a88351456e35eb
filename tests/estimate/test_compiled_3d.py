"""``estimate --compile --compile-scope block --tp N --sp --pp P [--dp D --fsdp full]`` (estimate/compiled_3d.py):
torchtitan's 3-D layout compiled. A stage keeps, per micro-batch in flight, the compiled TP-only saved set of
its own blocks (estimate/compiled_tp.py); the cut, the schedule's buffers and FSDP2's states are the eager
3-D estimate's. Exact (==) here, by name. Not traced: ``trace`` refuses TP beside PP (eager too), so the parts
are checked against the trace apart (tests/trace/test_trace_compile_tp.py, test_trace_compile_2d.py,
test_trace_pp_compile.py).
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from trainmem.cli import main
from trainmem.estimate import estimate
from trainmem.specs import ImplSpec, ParallelSpec, StepSpec
from trainmem.specs.loaders import spec_from_hf_config

LLAMA = dict(model_type="llama", hidden_size=64, intermediate_size=176, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=256, max_position_embeddings=256, tie_word_embeddings=False)
BLOCK = ImplSpec(device="cpu", attention="sdpa", compile=True, compile_scope="block")
IN_FLIGHT = "pipeline.in_flight_microbatches"


def _acts(items) -> dict[str, int]:
    return {i.name: i.bytes for i in items if i.category.value == "activation"}


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("precision,dp", [("fp32", 1), ("bf16", 1), ("fp32", 2), ("fsdp-bf16", 2)])
def test_a_stage_keeps_the_compiled_tp_set_per_microbatch_in_flight(schedule, precision, dp):
    model = spec_from_hf_config(LLAMA)
    step = StepSpec(batch=2, seq=64, precision=precision, optimizer="adamw")
    par = ParallelSpec(tp=2, sp=True, pp=2, schedule=schedule, microbatches=4, dp=dp, fsdp="full" if dp > 1 else None)
    # FSDP2's MixedPrecisionPolicy gathers bf16 weights: the compiled blocks save pure bf16's set (compiled_tp.py)
    tp_step = replace(step, precision="bf16") if precision == "fsdp-bf16" else step
    tp_alone = _acts(estimate(model, tp_step, BLOCK, parallel=ParallelSpec(tp=2, sp=True)).inventory.items)
    eager = estimate(model, step, replace(BLOCK, compile=False, compile_scope="model"), parallel=par).ranks
    seen: set[str] = set()
    for s, (rank, plain) in enumerate(zip(estimate(model, step, BLOCK, parallel=par).ranks, eager)):
        first, _ = rank.layers
        acts = _acts(rank.inventory.items)
        extra = acts.pop(IN_FLIGHT, 0)
        for name, nbytes in acts.items():
            own = name.removeprefix(f"stage{s}.")  # a later stage's own RoPE tables (estimate/parallel.py)
            received = name.startswith("model.layers.") and int(name.split(".")[2]) < first
            # the received block input is the stage's receive buffer (parallel_pp.py recv_input_aliases): 0 B
            assert nbytes == (0 if received else tp_alone[own]), name
            seen.add(own)
        # GPipe holds all 4 micro-batches, 1F1B pp - stage (parallel_pp.py in_flight)
        in_flight = 4 if schedule == "gpipe" else 2 - s
        assert extra == (in_flight - 1) * sum(acts.values())
        for ledger in ("parameter", "gradient", "optimizer_state", "buffer"):
            assert rank.totals_bytes[ledger] == plain.totals_bytes[ledger], (s, ledger)
    assert seen == tp_alone.keys()


def test_the_first_stage_in_bytes():
    """fp32, 1F1B, rank 0 of pp 2 (layers 0-1), tp 2 with SP, B 2, S 64, per micro-batch: ids 2·64·8 = 1,024
    + RoPE cos and sin 2·(64·16·4) = 8,192 + the reduce-scattered embedding 2·32·64·4 = 16,384 + blocks 0 and 1
    at 284,160 each (tests/estimate/test_compiled_tp.py) - block 1's output 2·32·64·4 = 16,384 (saved by block 2:
    the next stage's receive buffer) = 577,536; 1F1B keeps 2 in flight: 1,155,072."""
    par = ParallelSpec(tp=2, sp=True, pp=2, schedule="1f1b", microbatches=4)
    step = StepSpec(batch=2, seq=64, precision="fp32", optimizer="adamw")
    rank = estimate(spec_from_hf_config(LLAMA), step, BLOCK, parallel=par).ranks[0]
    acts = _acts(rank.inventory.items)
    assert acts[IN_FLIGHT] == 577_536
    assert rank.totals_bytes["activation"] == 1_155_072


@pytest.mark.parametrize("change,field", [
    (dict(schedule="interleaved"), "schedule='interleaved'"),
    (dict(dp=4, fsdp="hybrid", fsdp_group=2), "fsdp=hybrid"),
    (dict(cp=2), "cp=2"),
    (dict(dp=2), "dp=2"),
])
def test_what_the_compiled_3d_layout_does_not_model_is_one_line(change, field):
    from trainmem.errors import UnsupportedError

    par = ParallelSpec(**{**dict(tp=2, sp=True, pp=2, microbatches=4), **change})
    with pytest.raises(UnsupportedError) as err:
        estimate(spec_from_hf_config(LLAMA), StepSpec(batch=2, seq=64), BLOCK, parallel=par)
    assert field in str(err.value) and "\n" not in str(err.value)


def test_torchtitans_405b_runs_stay_uncompiled_under_full_recompute(capsys):
    """bench/published/cases.json's torchtitan-llama3.1-405b-3d-1f1b args with --compile: refused in one line,
    not for the layout but for --recompute full under compiled TP (estimate/compiled_tp.py)."""
    rc = main(["estimate", "--model", "llama-3.1-405b", "--precision", "fsdp-bf16", "--fsdp", "full", "--dp", "8",
               "--tp", "8", "--sp", "--pp", "8", "--microbatches", "8", "--batch", "4", "--seq", "8192",
               "--recompute", "full", "--schedule", "1f1b", "--compile", "--compile-scope", "block"])
    out, err = capsys.readouterr()
    assert rc == 2 and out == "" and err.count("\n") == 1 and "recompute='full'" in err, err
