"""``--cp N --cp-style ring``: torch's ring attention backward's own buffers (estimate/context_parallel.py
``ring_backward_bytes``) against the ring run by torch itself on fake tensors, CUDA's flash op standing in for
SDPA (cp_flash_standin.py ``traced_ring_step``: the ring functions' local ops recorded, collective waits
aliasing their outputs as on a device).

Measured, tiny Llama (hidden 64, 2 blocks, vocab 128), bf16, AdamW, the most bytes each ring backward call
allocates above its entry: 4 heads (hd 16), B 1, S/cp 32: cp 2 rank 0 104,704, rank 1 106,496; cp 4 ranks 0 and
3 126,976; B 2, cp 4 rank 1 253,952; 2 heads (hd 32), S/cp 16, cp 4 rank 2 63,488: the model's, to the byte.
(The forward's ring, 44,056-71,192 B above its entry at B 1, S/cp 32, is gone by the end of forward.)

The step (rank 0, no DDP in the trace: the estimate's ddp_gradient_buckets left out), estimate / trace:
cp 2 forward 825,424 / 826,752, backward 917,568 / 902,520 (1.0167: the ring's buffers sit on the estimate's
generic last-block moment, which holds the block's MLP activations the attention's backward moment has
freed), optimizer 986,304 / 986,816; cp 4 forward 825,424 / 827,776, backward 939,840 / 925,816 (1.0151). With
the two K/V buffers this replaces (16,384 B in every phase) the backward read 0.919 and 0.896.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
if not torch.distributed.is_available():  # pragma: no cover
    pytest.skip("torch.distributed is not available", allow_module_level=True)

sys.path.insert(0, str(Path(__file__).parent))
from cp_flash_standin import traced_ring_step  # noqa: E402

from trainmem.estimate import estimate  # noqa: E402
from trainmem.estimate.context_parallel import ring_backward_bytes  # noqa: E402
from trainmem.specs import ImplSpec, ParallelSpec, StepSpec  # noqa: E402
from trainmem.specs.loaders import spec_from_hf_config  # noqa: E402


def _tiny(heads: int) -> dict:
    return dict(model_type="llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=heads, num_key_value_heads=heads, vocab_size=128, max_position_embeddings=256)


def _ring_backward(cp: int, s: int, rank: int, batch: int, heads: int):
    result, calls = traced_ring_step(_tiny(heads), cp, cp * s, rank, batch)
    measured = {m for name, m, _ in calls if name.endswith("_backward")}  # one per block, all equal
    model = ring_backward_bytes(batch=batch, heads=heads, kv_heads=heads, seq=s, head_dim=64 // heads, cp=cp,
                                rank=rank, act_bytes=2)
    return result, measured, model


@pytest.mark.parametrize("cp,s,rank,batch,heads", [
    (2, 32, 0, 1, 4), (4, 32, 3, 1, 4), (4, 32, 1, 2, 4),
    pytest.param(2, 32, 1, 1, 4, marks=pytest.mark.slow), pytest.param(4, 16, 2, 1, 2, marks=pytest.mark.slow)])
def test_ring_backward_buffers_as_torch_runs_them(cp, s, rank, batch, heads):
    _, measured, model = _ring_backward(cp, s, rank, batch, heads)
    assert measured == {model}


def _phase_max(result) -> dict[str, int]:
    """The trace's most live bytes in each phase (its recording: allocation events and phase marks)."""
    rec = result.recording
    marks, phase, live, most = dict(rec.marks), None, 0, {}
    for i, e in enumerate(rec.events):
        phase = marks.get(i, phase)
        live += rec.blocks[e if e >= 0 else ~e].nbytes * (1 if e >= 0 else -1)
        if i >= rec.baseline:
            most[phase] = max(most.get(phase, 0), live)
    return most


@pytest.mark.slow
def test_rank_zero_step_against_the_estimate():
    """The phases of rank 0's step (module docstring): the ring's buffers counted at the last block's backward."""
    result, _, model = _ring_backward(2, 32, 0, 1, 4)
    est = estimate(spec_from_hf_config(_tiny(4)), StepSpec(batch=1, seq=64, precision="bf16"),
                   ImplSpec(device="cuda", attention="sdpa"), ParallelSpec(cp=2))
    phases = {p.name: p.bytes - p.parts.get("ddp_gradient_buckets", 0) for p in est.phases}
    traced = _phase_max(result)
    assert next(p for p in est.phases if p.name == "backward").parts["cp_ring_backward"] == model
    assert 1.0 < phases["backward"] / traced["backward"] < 1.02  # 917,568 / 902,520
    assert abs(phases["forward"] / traced["forward"] - 1) < 0.002  # 825,424 / 826,752
