"""``--cp N --cp-style ring``: torch's ring attention's own buffers (estimate/context_parallel.py
``ring_forward_bytes``, ``ring_backward_bytes``) and the step's phases (estimate/cp_ring_moments.py) against the
ring run by torch itself on fake tensors, CUDA's flash op standing in for SDPA (cp_flash_standin.py
``traced_ring_step``: the ring functions' local ops recorded, collective waits aliasing their outputs as on a
device, the flash op's philox seed and offset left out: host tensors on CUDA without dropout).

Measured, tiny Llama (hidden 64, 2 blocks, vocab 128), AdamW, the most bytes each ring call allocates above its
entry, bf16, 4 heads (hd 16), B 1, S/cp 32: backward cp 2 rank 0 104,704, rank 1 106,496, cp 4 ranks 0 and 3
126,976; forward cp 2 rank 0 44,032, rank 1 54,784, cp 4 rank 0 61,952, rank 3 71,168; B 2, cp 4 rank 1 and
2 heads (hd 32), S/cp 16, cp 4 rank 2 too: the model's, to the byte (fp32, cp 2: forward 65,536 and 67,072,
backward 151,808 and 147,456).

The step, the estimate (its DDP buckets left out: the trace runs no DDP; the worst rank's phases) / the trace per
rank, cp 2, B 1, S 64:
  bf16 --recompute none: forward 826,704 / rank 0 826,704, rank 1 818,512; backward 902,472 / 902,472, 900,168
  bf16 --recompute full: forward 675,008 / 664,256, 675,008; backward 904,008 / 902,216, 904,008
  fp32 --recompute none: forward 1,559,760 / 1,559,760, 1,543,376; backward 1,727,688 / 1,727,688, 1,723,336
  fp32 --recompute full: forward 1,305,664 / 1,304,128, 1,305,664; backward 1,727,944 / 1,727,944, 1,723,592
cp 4, bf16, ranks 0-3, S 128:
  --recompute none: forward 827,728 / 827,728, 827,728, 827,728, 819,536; backward 925,768 / 925,768 (ranks 0-2),
  921,672
  --recompute full: forward 692,416 / 683,200, 692,416 (ranks 1-3); backward 925,512 / 925,512 (every rank)
cp 2, bf16, B 2: --recompute none forward 1,060,056 / 1,060,056, 1,043,672 (ForCausalLMLoss's padded (B, S/cp+1)
labels, estimate/forward_held.py, now counted beside the ring too); backward 1,137,096 / 1,137,096, 1,132,488;
--recompute full backward 1,057,736 / 1,054,152, 1,057,736; forward 755,904 / 734,400, 755,904 (it read 756,432,
528 B over, while the ring's forward moment also took the padded labels, made after the blocks: peak.py now passes
it cp_ring_moments.before_the_head's buffers).
Before the ring's moments the backward read (cp 2, bf16) 917,568 at none (1.0167) and 839,232 at full (0.930
of rank 0's 902,240 then: the ring's buffers sat on the generic last-block moment, which
held the block's MLP activations at none and missed the first block's under full). The optimizer phase read
986,304 against 986,816: the caller's (B, S) ids, counted there since (parallel_pp.py ``optimizer_batch``).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
if not torch.distributed.is_available():  # pragma: no cover
    pytest.skip("torch.distributed is not available", allow_module_level=True)

sys.path.insert(0, str(Path(__file__).parent))
from cp_flash_standin import host_on_cuda, traced_ring_step  # noqa: E402

from trainmem.estimate import estimate  # noqa: E402
from trainmem.estimate.context_parallel import ring_backward_bytes, ring_forward_bytes  # noqa: E402
from trainmem.specs import ImplSpec, ParallelSpec, StepSpec  # noqa: E402
from trainmem.specs.loaders import spec_from_hf_config  # noqa: E402


def _tiny(heads: int) -> dict:
    return dict(model_type="llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=heads, num_key_value_heads=heads, vocab_size=128, max_position_embeddings=256)


def _ring(cp: int, s: int, rank: int, batch: int, heads: int):
    result, calls = traced_ring_step(_tiny(heads), cp, cp * s, rank, batch)
    kw = dict(batch=batch, heads=heads, kv_heads=heads, seq=s, head_dim=64 // heads, cp=cp, rank=rank, act_bytes=2)
    # one call per block and direction, all equal
    measured = {d: {m for name, m, _ in calls if name.endswith("_backward") == (d == "backward")}
                for d in ("forward", "backward")}
    return result, measured, {"forward": ring_forward_bytes(**kw), "backward": ring_backward_bytes(**kw)}


@pytest.mark.parametrize("cp,s,rank,batch,heads", [
    (2, 32, 0, 1, 4), (4, 32, 3, 1, 4), (4, 32, 1, 2, 4),
    pytest.param(2, 32, 1, 1, 4, marks=pytest.mark.slow), pytest.param(4, 16, 2, 1, 2, marks=pytest.mark.slow)])
def test_ring_buffers_as_torch_runs_them(cp, s, rank, batch, heads):
    _, measured, model = _ring(cp, s, rank, batch, heads)
    assert measured == {d: {b} for d, b in model.items()}


def _phase_max(result) -> dict[str, int]:
    """The trace's most live bytes in each phase (its recording: allocation events and phase marks), the flash
    op's host tensors left out (cp_flash_standin.py ``host_on_cuda``)."""
    rec = result.recording
    marks, phase, live, most = dict(rec.marks), None, 0, {}
    for i, e in enumerate(rec.events):
        phase = marks.get(i, phase)
        block = rec.blocks[e if e >= 0 else ~e]
        if not host_on_cuda(block):
            live += block.nbytes * (1 if e >= 0 else -1)
        if i >= rec.baseline:
            most[phase] = max(most.get(phase, 0), live)
    return most


@pytest.mark.slow
@pytest.mark.parametrize("cp,recompute,precision,batch", [
    (2, "none", "bf16", 1), (2, "full", "bf16", 1), (2, "full", "fp32", 1), (4, "full", "bf16", 1),
    (2, "none", "bf16", 2), (2, "full", "bf16", 2)])
def test_worst_rank_step_against_the_estimate(cp, recompute, precision, batch):
    """The estimate's phases are the worst rank's (module docstring): its forward and its backward (the largest
    of its backward phases) each equal the largest of the ranks' traced ones, to the byte."""
    s = 32
    traced = [_phase_max(traced_ring_step(_tiny(4), cp, cp * s, rank, batch, full=recompute == "full",
                                          precision=precision)[0]) for rank in range(cp)]
    est = estimate(spec_from_hf_config(_tiny(4)), StepSpec(batch=batch, seq=cp * s, precision=precision),
                   ImplSpec(device="cuda", attention="sdpa", recompute=recompute), ParallelSpec(cp=cp))
    phases = {p.name: p.bytes - p.parts.get("ddp_gradient_buckets", 0) for p in est.phases}
    assert "cp_ring_backward" not in next(p for p in est.phases if p.name == "backward").parts  # a node moment
    assert max(v for k, v in phases.items() if k.startswith("backward")) == max(t["backward"] for t in traced)
    assert phases["forward"] == max(t["forward"] for t in traced)


@pytest.mark.parametrize("recompute,par,moment", [
    ("none", dict(cp=2), True), ("full", dict(cp=2, dp=2), True), ("selective", dict(cp=2), False),
    ("none", dict(cp=2, tp=2), False), ("none", dict(cp=2, pp=2), False)])
def test_ring_rides_the_node_moments_only_where_measured(recompute, par, moment):
    """The ring's buffers are node moments beside DP ranks under --recompute none or full (measured above);
    elsewhere they stay on the generic last-block moment, counted in the backward phase's parts."""
    est = estimate(spec_from_hf_config(_tiny(4)), StepSpec(batch=1, seq=64, precision="bf16"),
                   ImplSpec(device="cuda", attention="sdpa", recompute=recompute), ParallelSpec(**par))
    parts = {k for p in est.phases if p.name.startswith("backward") for k in p.parts}
    assert ("cp_ring_backward" in parts) is not moment
