"""The caller's batch in the optimizer phase (``PhaseInputs.optimizer_batch``): a training loop binds its batch for
the whole step, so while ``optimizer.step()`` runs the token ids (and a classifier's labels, a tensor of their own)
are alive beside no activation. The trace registers them as its inputs for the whole step (trace/step.py
``one_step``); a real CPU step holds them too (tests/estimate/test_optimizer_impl.py ``_real_step``, where
real == trace + Adam's host step counters). Before, the estimate left them out there: the trace's optimizer phase
was B·S·8 (+ the labels) over it. Tiny untied Llama h64, 2 layers, V256, fp32, B2 S64, AdamW foreach, CPU kernels.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from trainmem.estimate import estimate
from trainmem.specs import ImplSpec, ParallelSpec, StepSpec
from trainmem.specs.loaders import spec_from_hf_config

CFG = dict(model_type="llama", hidden_size=64, intermediate_size=176, num_hidden_layers=4, num_attention_heads=4,
           num_key_value_heads=2, vocab_size=256, max_position_embeddings=512, num_labels=3, tie_word_embeddings=False)
B, S = 2, 64
IDS = B * S * 8  # (B, S) int64: 1,024 B
IMPL = ImplSpec(attention="sdpa", device="cpu", optimizer_impl="foreach")
STEP = StepSpec(batch=B, seq=S, precision="fp32")


def _spec(head: str):
    return replace(spec_from_hf_config(CFG), head=head, num_labels=3) if head != "lm" else spec_from_hf_config(CFG)


def _optimizer(phases):
    return next(p for p in phases if p.name == "optimizer")


@pytest.mark.parametrize("head,want", [
    ("lm", IDS),                  # the labels are the ids
    ("seq-cls", IDS + B * 8),     # (B,) int64 labels: 16 B
    ("token-cls", IDS + IDS),     # (B, S) int64 labels: 1,024 B
])
def test_one_device_counts_the_callers_batch(head, want):
    assert _optimizer(estimate(_spec(head), STEP, IMPL).phases).parts["caller_ids"] == want


def test_pipeline_stages_count_the_whole_batch_on_the_first_and_last():
    # 4 micro-batches of (2, 64) ids on the first stage (what step() was given), the targets on the last: 4,096 B
    ranks = estimate(_spec("lm"), STEP, IMPL, parallel=ParallelSpec(pp=4, microbatches=4)).ranks
    assert [_optimizer(r.phases).parts.get("caller_ids", 0) for r in ranks] == [4 * IDS, 0, 0, 4 * IDS]


def test_context_parallel_ranks_keep_the_whole_sequence():
    # context_parallel shards the batch in place (resize_ keeps the storage): (B, S) ids per rank, not (B, S/cp)
    (rank,) = estimate(_spec("lm"), STEP, IMPL, parallel=ParallelSpec(cp=2)).ranks
    assert _optimizer(rank.phases).parts["caller_ids"] == IDS


@pytest.mark.slow  # three fake-tensor traces, ~3 s each
@pytest.mark.parametrize("head", ["lm", "seq-cls", "token-cls"])
def test_optimizer_phase_equals_the_trace(head):
    torch = pytest.importorskip("torch")  # noqa: F841
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).parent))
    from test_optimizer_impl import _phase_peaks

    from trainmem.inventory import Category
    from trainmem.trace import trace_step
    est, t = estimate(_spec(head), STEP, IMPL), trace_step(CFG, STEP, IMPL, head=head)
    assert _optimizer(est.phases).parts["caller_ids"] == sum(i.bytes for i in t.items if i.category is Category.INPUT)
    # measured: lm 4,354,368 B; seq-cls 4,030,544 B; token-cls 4,031,612 B (1,024; 1,040; 2,048 B under before)
    assert _phase_peaks(t, "optimizer")[0] == _optimizer(est.phases).bytes
