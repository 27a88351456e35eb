"""A pipeline stage's peak inside its last block's backward (estimate/parallel_pp.py ``stage_node_moments``):
the eager SwiGLU product's backward moment (estimate/block_backward.py) beside the schedule's buffers, with the
stage's output gradient counted once, as the receive buffer (``pp_recv_gradients``), and the embedding's
gradient not yet made on the first stage (it comes after every block's). Exact (==) on the tiny Llama of
tests/trace/test_trace_pp.py, whose traced peaks these moments are (slow: GPipe rank 0 estimate == trace,
7,097,408 B; 1F1B rank 0 0.9996)."""

from __future__ import annotations

import pytest

from trainmem.estimate import estimate
from trainmem.specs import ImplSpec, ParallelSpec, StepSpec
from trainmem.specs.loaders import spec_from_hf_config

LLAMA = dict(model_type="llama", hidden_size=64, intermediate_size=176, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=256, max_position_embeddings=256, tie_word_embeddings=False)
B, S, H, F = 2, 64, 64, 176


def _stage0(schedule: str, **par):
    step = StepSpec(batch=B, seq=S, precision="fp32", optimizer="adamw")
    return estimate(spec_from_hf_config(LLAMA), step, ImplSpec(device="cpu", attention="sdpa"),
                    parallel=ParallelSpec(pp=2, schedule=schedule, microbatches=4, **par)).ranks[0]


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_the_first_stage_peaks_in_its_last_blocks_swiglu_backward(schedule):
    peak = _stage0(schedule).peak
    assert peak.name == "backward" and "MLP product" in peak.note
    # MulBackward0 of act_fn(gate) * up: the down projection's input gradient and the two products' gradients,
    # 3 x B·S·F fp32 = 3 x 2·64·176·4; the output gradient (B·S·H) is the receive buffer, not counted again
    assert peak.parts["node_work"] == 3 * B * S * F * 4
    assert peak.parts["pp_recv_gradients"] == 4 * B * S * H * 4  # one receive buffer per micro-batch
    if schedule == "gpipe":  # the first micro-batch's backward: only down_proj's weight gradient exists (64·176·4),
        assert peak.parts["gradients"] == H * F * 4  # not the embedding's, which comes after every block's


@pytest.mark.parametrize("par", [dict(dp=2, fsdp="full"), dict(schedule="interleaved", virtual_stages=2)])
def test_layouts_not_checked_keep_the_blocks_working_set(par):
    """FSDP2 per stage and the interleaved schedule keep the working-set estimate (no node moment)."""
    schedule = par.pop("schedule", "1f1b")
    assert "node_work" not in _stage0(schedule, **par).peak.parts
