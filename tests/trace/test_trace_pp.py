"""``trainmem trace --pp N``: torch.distributed.pipelining's real schedule as one pipeline rank in
torch's fake process group (trace/parallel_pp.py), against ``estimate --pp N --device cpu``.

Tiny Llama (hidden 64, FFN 176, 4 layers, vocabulary 256, untied), B 2 per micro-batch, S 64, fp32,
AdamW, pp 2, 4 micro-batches. Per rank, per schedule (GPipe, 1F1B, interleaved 1F1B with 2 virtual
stages):
  - parameters, gradients, AdamW states == the estimate's pp_stage_R to the byte; the receive
    buffers PipelineStage keeps (one per micro-batch: activations into every stage but the first,
    gradients into every stage but the last) == the estimate's pp_recv_activations + pp_recv_gradients;
  - activations held at once (the trace's most live activation bytes) differ from the estimate's
    activation ledger by named mechanisms only, with one = B·S·H·4 = 32,768 B, ids = B·S·8 = 1,024 B,
    logits = B·S·V·4 = 131,072 B:
      first rank: − n·ids (the trace counts the ids as its input) + k·one (the stage outputs the
      schedule keeps, which the estimate counts as buffers.pp_stage_outputs, asserted == k·one: GPipe 4
      until their backward, 1F1B 2 in its warm-up and a third, the last warm-up send's Work, see below;
      estimate/pp_schedule.py ``stage_outputs_held``);
      last rank: 4·logits (the schedule's ``output_chunks``, the estimate's pp_output_chunks) + the
      losses the schedule keeps (``_internal_losses``: under 1F1B three more than the estimate's one,
      12 B) + backward's 0-d gradient seed (4 B, as on one device); its input, the receive buffer itself
      (stage.py ``_retrieve_recv_activations``), is counted once, as pp_recv_activations (the first
      block's saved input is 0 B there: estimate/parallel_pp.py ``recv_input_aliases``);
  - the step peak (logical): estimate/trace (PEAK_RATIO; see docs/trace.md), GPipe and 1F1B exact on both ranks
    (the stages' node moments, estimate/parallel_pp.py ``stage_node_moments``, beside the caller's batch and the
    schedule's losses, ``caller_batch``), interleaved 0.998-1.015.

A real gloo send Work references its tensor until the schedule drops the Work, and the schedules
keep some (Schedule1F1B: the last warm-up send it fires in ``send_work`` through the steady phase;
ScheduleInterleaved1F1B's runtime every send in ``send_ops`` until the step ends); the fake
group's Works hold nothing, so the trace wraps each send's Work to hold its tensors
(``_sends_hold_their_tensors``). Against a real 2-rank gloo step: tests/trace/test_trace_pp_real.py.
"""

from __future__ import annotations

import collections

import pytest

torch = pytest.importorskip("torch")
if not torch.distributed.is_available():  # pragma: no cover
    pytest.skip("torch.distributed is not available", allow_module_level=True)

from trainmem.cli import main  # noqa: E402
from trainmem.estimate import estimate  # noqa: E402
from trainmem.specs import ImplSpec, ParallelSpec, StepSpec  # noqa: E402
from trainmem.specs.loaders import spec_from_hf_config  # noqa: E402

LLAMA = dict(model_type="llama", hidden_size=64, intermediate_size=176, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=256, max_position_embeddings=256, tie_word_embeddings=False)
IMPL = ImplSpec(device="cpu", attention="sdpa")
STEP = StepSpec(batch=2, seq=64, precision="fp32", optimizer="adamw")
ONE, IDS, LOGITS = 2 * 64 * 64 * 4, 2 * 64 * 8, 2 * 64 * 256 * 4


def _cli(capsys, *argv):
    rc = main(["trace", "--model", "llama-3-8b", "--seq", "16", *argv])
    out, err = capsys.readouterr()
    return rc, out, err


@pytest.mark.parametrize("argv,flag", [
    (["--pp", "2", "--microbatches", "1"], "microbatches"),  # Schedule1F1B needs m >= stages
    (["--pp", "64", "--microbatches", "64"], "pp"),  # llama-3-8b: 32 layers (the estimate's validate)
    (["--pp", "2", "--microbatches", "2", "--layer-split", "10,10"], "layer_split"),
    (["--pp", "2", "--microbatches", "4", "--schedule", "interleaved", "--virtual-stages", "3"], "virtual_stages"),
    (["--pp", "2", "--microbatches", "5", "--schedule", "interleaved", "--virtual-stages", "2"], "microbatches"),
    (["--pp", "2", "--microbatches", "2", "--schedule", "zero-bubble"], "--schedule zero-bubble"),
    (["--pp", "2", "--microbatches", "2", "--pp-rank", "2"], "pp_rank"),
    (["--pp-rank", "1"], "pp_rank"),
    (["--pp", "2", "--microbatches", "2", "--dp", "2"], "--dp 2"),  # replicated stages: FSDP2 only
    (["--pp", "2", "--microbatches", "2", "--dp", "2", "--fsdp", "hybrid"], "--fsdp hybrid"),
    (["--pp", "2", "--microbatches", "4", "--dp", "2", "--fsdp", "full", "--schedule", "interleaved",
      "--virtual-stages", "2"], "--schedule interleaved"),
    (["--pp", "2", "--microbatches", "2", "--compile"], "--compile-scope model"),  # per-block compile only
    (["--pp", "2", "--microbatches", "4", "--compile", "--compile-scope", "block", "--schedule", "interleaved",
      "--virtual-stages", "2"], "--schedule interleaved"),
    (["--pp", "2", "--microbatches", "2", "--grad-accum", "2"], "--grad-accum 2"),
    (["--pp", "2", "--microbatches", "2", "--profile", "reference"], "--pp"),
])
def test_what_pp_trace_cannot_run_is_one_line(capsys, argv, flag):
    rc, out, err = _cli(capsys, *argv)
    assert rc == 2 and out == ""
    assert err.count("\n") == 1 and flag in err


def _ledgers(items) -> dict[str, int]:
    out: dict[str, int] = collections.defaultdict(int)
    for it in items:
        out[it.category.value] += it.bytes
    return out


def held_activations(result, *, saved_only: bool = False) -> int:
    """The most activation bytes (logical) alive at once in the traced step (``saved_only``: those the
    saved-tensor hooks saw, what the torchrun worker's LiveTracker counts)."""
    from trainmem.inventory import Category
    from trainmem.trace.result import categorize

    rec = result.recording
    cats = categorize(rec)
    cur = top = 0
    for e in rec.events:
        b = rec.blocks[e if e >= 0 else ~e]
        if cats[b.id] is Category.ACTIVATION and (b.saved or not saved_only):
            cur += b.nbytes if e >= 0 else -b.nbytes
            top = max(top, cur)
    return top


# (schedule, rank): trace held activations - estimate activation ledger, by mechanism (module docstring)
HELD_MINUS_ESTIMATE = {
    ("gpipe", 0): -4 * IDS + 4 * ONE,
    ("gpipe", 1): 4 * LOGITS + 4,
    ("1f1b", 0): -2 * IDS + 3 * ONE,
    ("1f1b", 1): 4 * LOGITS + 12 + 4,
}
# stage outputs the first rank holds at once (the k·one above), the estimate's buffers.pp_stage_outputs
OUTPUTS_HELD = {("gpipe", 0): 4 * ONE, ("1f1b", 0): 3 * ONE, ("interleaved", 0): 8 * ONE, ("interleaved", 1): 4 * ONE}
CASES = [("gpipe", 0), ("gpipe", 1), ("1f1b", 0), ("1f1b", 1), ("interleaved", 0), ("interleaved", 1)]
# estimate / trace step peak (logical bytes), measured; docs/trace.md says what each side holds that the other
# does not (under interleaved the estimate's outputs and sent input gradients at its own worst moment, not the
# trace's, and no node moment: estimate/parallel_pp.py stage_node_moments). 1.0: exact (==)
PEAK_RATIO = {("gpipe", 0): 1.0, ("gpipe", 1): 1.0, ("1f1b", 0): 1.0, ("1f1b", 1): 1.0,
              ("interleaved", 0): 0.9977, ("interleaved", 1): 1.0154}


@pytest.mark.slow  # ~10-25 s each on 2 shared cores
@pytest.mark.parametrize("schedule,rank", CASES, ids=[f"{s}-rank{r}" for s, r in CASES])
def test_pp2_trace_against_the_estimate(schedule, rank):
    from trainmem.trace import trace_step

    par = ParallelSpec(pp=2, schedule=schedule, microbatches=4, virtual_stages=2 if schedule == "interleaved" else 1)
    traced = trace_step(LLAMA, STEP, IMPL, parallel=par, pp_rank=rank)
    cls = {c.name: c for c in estimate(spec_from_hf_config(LLAMA), STEP, IMPL, parallel=par).ranks}[f"pp_stage_{rank}"]
    t, e = _ledgers(traced.items), _ledgers(cls.inventory.items)
    for ledger in ("parameter", "gradient", "optimizer_state"):
        assert t[ledger] == e[ledger], ledger
    recv = sum(i.bytes for i in traced.items if i.name.startswith("pipeline.stage"))
    assert recv == sum(i.bytes for i in cls.inventory.items if i.name.startswith("buffers.pp_recv_"))
    assert t["buffer"] - recv == e["buffer"] - sum(i.bytes for i in cls.inventory.items if i.name.startswith("buffers.pp_"))
    if (schedule, rank) in HELD_MINUS_ESTIMATE:
        assert held_activations(traced) - e["activation"] == HELD_MINUS_ESTIMATE[schedule, rank]
    outputs = sum(i.bytes for i in cls.inventory.items if i.name == "buffers.pp_stage_outputs")
    assert outputs == OUTPUTS_HELD.get((schedule, rank), 0)
    assert cls.peak_bytes / traced.peak_logical_bytes == pytest.approx(PEAK_RATIO[schedule, rank], abs=0.001)
    assert PEAK_RATIO[schedule, rank] != 1.0 or cls.peak_bytes == traced.peak_logical_bytes  # 7,097,408 B
    assert traced.meta["pp"] == {"pp": 2, "rank": rank, "schedule": schedule, "microbatches": 4,
                                 "stages": [rank, rank + 2] if schedule == "interleaved" else [rank],
                                 "process_group": "fake"}


@pytest.mark.slow
def test_cli_traces_a_pipeline_rank(capsys, tmp_path):
    import json

    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(LLAMA))
    argv = ["trace", "--model", str(cfg), "--batch", "2", "--seq", "64", "--pp", "2", "--microbatches", "2",
            "--device", "cpu", "--attention", "sdpa", "--optimizer", "adamw", "--pp-rank", "1"]
    assert main(argv) == 0
    out, _ = capsys.readouterr()
    assert "pipeline: rank 1 of 2 (torch's fake process group), stage(s) 1, 1f1b over 2 micro-batches" in out
    assert main(argv + ["--json"]) == 0
    got = json.loads(capsys.readouterr()[0])
    assert got["meta"]["pp"]["rank"] == 1
    assert any(i["name"] == "lm_head.weight" for i in got["items"])
    assert not any(i["name"].startswith("model.embed_tokens") for i in got["items"])


# estimate / trace step peak under FSDP2 per stage (dp 2), measured
FSDP_PEAK_RATIO = {("1f1b", 0): 0.9942, ("1f1b", 1): 1.0253}  # rank 1: 1.0242 before the caller's targets (4,108 B)


@pytest.mark.slow  # ~20-45 s each on 2 shared cores
@pytest.mark.parametrize("rank", [0, 1])
def test_fsdp2_under_pp_reduces_once_after_the_last_microbatch(rank):
    """``--pp 2 --dp 2 --fsdp full``: each stage FSDP2-sharded over its data-parallel pair (a (pp, dp) fake
    mesh, traced as data-parallel rank 0), as torchtitan and the torchrun worker (``pp_dp``) shard it.
    The schedule turns gradient sync off until the stage's last micro-batch (``backward_maybe_with_nosync``,
    ``perform_reduce_grad``), so autograd's unsharded gradients accumulate across the 4 micro-batches and
    each FSDP unit (2 blocks + the stage root) makes its reduce-scatter input once per step, not per
    micro-batch: 3 inputs, together the stage's unsharded gradients (2 x the sharded ones). Peak
    estimate/trace 0.994 (rank 0) and 1.024 (rank 1)."""
    from trainmem.trace import trace_step

    par = ParallelSpec(pp=2, dp=2, fsdp="full", schedule="1f1b", microbatches=4)
    traced = trace_step(LLAMA, STEP, IMPL, parallel=par, pp_rank=rank)
    cls = {c.name: c for c in estimate(spec_from_hf_config(LLAMA), STEP, IMPL, parallel=par).ranks}[f"pp_stage_{rank}"]
    t, e = _ledgers(traced.items), _ledgers(cls.inventory.items)
    for ledger in ("parameter", "gradient", "optimizer_state"):
        assert t[ledger] == e[ledger], ledger
    blocks = traced.recording.blocks
    # foreach_reduce's reduce-scatter input (torch.empty, _fsdp_collectives.py): the only torch.empty on the
    # default stream (the all-gathers' are on FSDP's all-gather stream), all made after the last backward op
    reduce_inputs = [b for b in blocks if b.op == "empty" and b.stream == 0]
    assert len(reduce_inputs) == 3
    assert min(b.alloc_at for b in reduce_inputs) > max(b.alloc_at for b in blocks if b.phase == "backward")
    assert sum(b.nbytes for b in reduce_inputs) == 2 * t["gradient"]
    assert cls.peak_bytes / traced.peak_logical_bytes == pytest.approx(FSDP_PEAK_RATIO["1f1b", rank], abs=0.001)
    assert traced.meta["pp"]["fsdp"] == {"dp": 2, "dp_rank": 0, "reshard_after_forward": True}
