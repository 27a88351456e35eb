"""Pipeline stage I/O in the estimate (issue 13, mechanism 5), what torch.distributed.pipelining keeps
(torch 2.13, checked against its real schedule in tests/trace/test_trace_pp.py):

* stage outputs the schedule's sends keep past their backward (estimate/pp_schedule.py
  ``stage_outputs_held``): 1F1B's ``send_work`` keeps the last warm-up send until the 1B1F loop ends,
  GPipe's ``fwd_sends_to_wait`` and the interleaved runtime's ``send_ops`` every send until ``step``
  returns;
* input gradients the sends keep (``stage_io_held``): GPipe's ``bwd_sends_to_wait`` and the runtime's
  ``send_ops`` every one until ``step`` returns, 1F1B's ``bwd_sends``/``send_work`` the previous one;
* a receiving stage's input is its receive buffer (estimate/parallel_pp.py ``recv_input_aliases``).
"""

from __future__ import annotations

import pytest

from trainmem.estimate import estimate
from trainmem.estimate.pp_schedule import stage_io_held, stage_outputs_held
from trainmem.specs import ImplSpec, ParallelSpec, StepSpec
from trainmem.specs.loaders import spec_from_hf_config

LLAMA = dict(model_type="llama", hidden_size=64, intermediate_size=176, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=256, max_position_embeddings=256, tie_word_embeddings=False)
ONE = 2 * 64 * 64 * 4  # B·S·H·4 = 32,768 B


@pytest.mark.parametrize("schedule,pp,v,m,rank,held", [
    ("gpipe", 2, 1, 4, 0, (4, 4)),  # every output until step returns (fwd_sends_to_wait)
    ("gpipe", 2, 1, 4, 1, (0, 0)),  # the model's last stage sends nothing (its logits: output_chunks)
    # F0 F1 B0 F2 B1 F3 B2 B3: after F2 out0 (send_work) out1 out2; after B3 out3 (fwd_sends' P2POp)
    ("1f1b", 2, 1, 4, 0, (3, 1)),
    # warm-up 4: out2 held until B4, so after F6 (B0..B2 done): out2..out6
    ("1f1b", 4, 1, 8, 0, (5, 1)),
    ("1f1b", 4, 1, 8, 2, (3, 1)),
    ("interleaved", 2, 2, 4, 0, (8, 8)),  # stages 0 and 2 send; send_ops kept until the last action
    ("interleaved", 2, 2, 4, 1, (4, 4)),  # stage 1 sends, stage 3 is the last
])
def test_stage_outputs_the_sends_keep(schedule, pp, v, m, rank, held):
    assert stage_outputs_held(schedule, pp=pp, v=v, m=m, rank=rank) == held


@pytest.mark.parametrize("schedule,rank,io", [
    # (outputs, sent input gradients) at the worst forward, worst backward, after the last backward
    ("gpipe", 1, {"forward": (0, 0), "backward": (0, 0), "end": (0, 4)}),  # bwd_sends_to_wait: all 4 at the end
    ("1f1b", 0, {"forward": (3, 0), "backward": (3, 0), "end": (1, 0)}),  # stage 0 receives no gradient to send
    ("1f1b", 1, {"forward": (0, 1), "backward": (0, 1), "end": (0, 1)}),  # the previous backward's, until the next
    ("interleaved", 1, {"forward": (4, 5), "backward": (4, 5), "end": (4, 8)}),  # send_ops: every send to the end
])
def test_what_the_sends_keep_at_the_worst_moments(schedule, rank, io):
    assert stage_io_held(schedule, pp=2, v=2, m=4, rank=rank, held=[1e6, 1e6], one=1) == io


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_received_input_is_the_receive_buffer(schedule):
    step = StepSpec(batch=2, seq=64, precision="fp32", optimizer="adamw")
    impl = ImplSpec(device="cpu", attention="sdpa")
    ranks = {c.name: c for c in estimate(spec_from_hf_config(LLAMA), step, impl,
                                         parallel=ParallelSpec(pp=2, schedule=schedule, microbatches=4)).ranks}
    items = {i.name: i for i in ranks["pp_stage_1"].inventory.items}
    assert items["buffers.pp_recv_activations"].bytes == 4 * ONE
    assert items["model.layers.1.residual_mlp"].bytes == 0  # stage 1's input, saved by layer 2's norm
    first = {i.name: i for i in ranks["pp_stage_0"].inventory.items}
    assert first["model.embed_tokens.out"].bytes == ONE  # the first stage's input is its own
    assert first["buffers.pp_stage_outputs"].bytes == (4 if schedule == "gpipe" else 3) * ONE
