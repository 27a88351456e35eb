"""Pipeline stages (torch.distributed.pipelining): the caller's batch, the schedule's losses and GPipe's second
backward (estimate/parallel_pp.py ``caller_batch``, ``later_microbatch``). Exact integers for the tiny Llama of
tests/trace/test_trace_pp.py, B 2 per micro-batch, S 64, 4 micro-batches; against the trace:
tests/trace/test_trace_pp.py, test_trace_pp_compile.py, test_trace_pp_compile_op.py (slow)."""

from __future__ import annotations

import pytest

from trainmem.estimate import estimate
from trainmem.estimate.parallel_pp import caller_batch, later_microbatch
from trainmem.inventory import Category, MemoryItem
from trainmem.specs import ImplSpec, ParallelSpec, StepSpec
from trainmem.specs.loaders import spec_from_hf_config

LLAMA = dict(model_type="llama", hidden_size=64, intermediate_size=176, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=256, max_position_embeddings=256, tie_word_embeddings=False)
IDS = 2 * 64 * 8  # one micro-batch's int64 token ids: 1,024 B
_INDICES = MemoryItem.make("model.embed_tokens.indices", Category.ACTIVATION, (2, 64), "int64", IDS)
_LOSS = MemoryItem.make("loss.value", Category.ACTIVATION, (), "float32", 4)


@pytest.mark.parametrize("schedule,stage,want", [
    ("1f1b", 0, {"pp_batch_ids": (4 - 2) * IDS}),  # 4 micro-batches' ids, 2 in flight saved by the embedding
    ("gpipe", 0, {}),  # every micro-batch in flight: the embedding saves every chunk of the batch
    ("1f1b", 1, {"pp_batch_targets": 4 * IDS, "pp_losses": 3 * 4}),  # 4 096 B of targets; 3 more 4 B losses
    ("gpipe", 1, {"pp_batch_targets": 4 * IDS}),  # each micro-batch's loss is counted in flight already
])
def test_the_caller_batch_beside_a_stage(schedule, stage, want):
    par = ParallelSpec(pp=2, schedule=schedule, microbatches=4)
    items = [_INDICES] if stage == 0 else [_LOSS]
    assert caller_batch(par, stage, items, batch=2, seq=64) == want


def test_gpipe_second_backward_holds_one_micro_batch_less_but_its_ids_and_loss():
    body = 177_152  # one micro-batch's stage activations
    inflight = MemoryItem.make("pipeline.in_flight_microbatches", Category.ACTIVATION, (), "bfloat16", 3 * body)
    items = [_INDICES, _LOSS, inflight]
    later = later_microbatch(ParallelSpec(pp=2, schedule="gpipe", microbatches=4), items, body)
    assert [i.bytes for i in later] == [IDS, 4, 2 * body + IDS + 4]  # (4 − 2) micro-batches + the first's ids, loss
    assert later_microbatch(ParallelSpec(pp=2, schedule="1f1b", microbatches=4), items, body) is None
    assert later_microbatch(ParallelSpec(pp=2, schedule="gpipe", microbatches=4, dp=2, fsdp="full"), items,
                            body) is None  # no node moments under FSDP2 per stage (parallel_pp.stage_node_moments)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_op_checkpointed_compiled_stages_estimate(schedule):
    """The estimate of test_trace_pp_compile_op.py's bf16 stages, where the trace's peaks were measured: the same
    integers (rank 0's phase with GPipe's second backward, rank 1's first block)."""
    step = StepSpec(batch=2, seq=64, precision="bf16", optimizer="adamw")
    impl = ImplSpec(device="cpu", attention="sdpa", compile=True, compile_scope="block", recompute="op")
    ranks = estimate(spec_from_hf_config(LLAMA), step, impl,
                     parallel=ParallelSpec(pp=2, schedule=schedule, microbatches=4)).ranks
    want = {"gpipe": (2_053_184, 2_809_696), "1f1b": (1_860_672, 1_914_452)}[schedule]
    assert tuple(r.peak_bytes for r in ranks) == want
