"""``--cp N --cp-style ring``: the eager saved set against torch's own context parallelism (estimate/context_parallel.py).

torch 2.13's ``context_parallel`` (ring, all-gather rotation, head-tail load balancing) run unmodified on fake
tensors, CUDA's flash op standing in for SDPA (cp_flash_standin.py), on each rank in torch's fake process group.
Measured, tiny Llama (hidden 64, 4 heads, 4 K/V heads, 2 blocks, vocab 128), bf16, B=1, S/cp=32:

* one device at S=32 with the same op keeps 200,892 B; the CP ranks keep cp=2 rank 0 209,340, rank 1 201,148;
  cp=4 ranks 0-2 209,852, rank 3 201,660;
* the difference is, per block on every rank but the last, the (B·S/cp, H) copy of the merged attention output
  that ``o_proj`` keeps (4,096 B here), and on every rank the ids' storage, which ``context_parallel`` cuts in
  place with ``resize_`` (a smaller size keeps the storage: B·S·8 B instead of B·(S/cp)·8, +256 B cp 2, +768 B
  cp 4; the estimate counts the rank's B·(S/cp) ids as the embedding's and the rest as a buffer,
  estimate/context_parallel.py ``buffer_copies_bytes``);
* the estimate's CP activations (209,040 B) minus its one-device S/cp activations (200,848 B) are the two copies,
  8,192 B, for cp 2 and 4; the one-device difference (+44 B: the flash meta kernel's philox seed and offset,
  24 B per call, less the loss's total_weight, 4 B) is not CP's.

Under ``--recompute full`` (every block checkpointed) a CP rank keeps one device's set at S/cp and the ids'
whole storage: 41,868 B (cp 2, either rank) vs 41,612 B; the estimate's CP activations equal its one-device ones.
"""

from __future__ import annotations

import collections
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
if not torch.distributed.is_available():  # pragma: no cover
    pytest.skip("torch.distributed is not available", allow_module_level=True)

sys.path.insert(0, str(Path(__file__).parent))
from cp_flash_standin import cp_saved  # noqa: E402

from trainmem.estimate import estimate  # noqa: E402
from trainmem.inventory import Category  # noqa: E402
from trainmem.specs import ImplSpec, ParallelSpec, StepSpec  # noqa: E402
from trainmem.specs.loaders import spec_from_hf_config  # noqa: E402

TINY = dict(model_type="llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=4, vocab_size=128, max_position_embeddings=256)
IMPL = ImplSpec(device="cuda", attention="sdpa")  # CP's ring exists for CUDA's fused kernels only


def _kept(saved) -> collections.Counter:
    """Shapes, dtypes and bytes (the grad_fn differs: CP's q, k, v are saved from DTensor.from_local)."""
    return collections.Counter((s.shape, s.dtype, s.nbytes) for s in saved)


def _activations(cp: int, seq: int, impl: ImplSpec = IMPL) -> int:
    est = estimate(spec_from_hf_config(TINY), StepSpec(batch=1, seq=seq, precision="bf16"), impl, ParallelSpec(cp=cp))
    return sum(i.bytes for i in est.inventory if i.category is Category.ACTIVATION)


@pytest.mark.parametrize("cp,rank", [(2, 0), (2, 1), (4, 0), (4, 3)])
def test_ring_rank_keeps_one_device_set_and_the_merged_output_copy(cp, rank):
    s, hidden, layers = 32, 64, 2
    ring = cp_saved(TINY, cp, cp * s, rank)
    alone = cp_saved(TINY, 1, s)
    copy = ((s, hidden), "bfloat16", s * hidden * 2)  # o_proj's input, one per block
    ids = ((1, s), "int64", cp * s * 8)  # the embedding's indices: context_parallel's resized ids
    extra = collections.Counter({copy: layers} if rank < cp - 1 else {}) + collections.Counter({ids: 1})
    assert _kept(ring) - _kept(alone) == extra
    assert _kept(alone) - _kept(ring) == collections.Counter({((1, s), "int64", s * 8): 1})
    # the estimate's worst rank: one device's set at S/cp and the copies
    assert _activations(cp, cp * s) - _activations(1, s) == layers * s * hidden * 2


def test_checkpointed_ring_rank_keeps_one_device_set():
    s = 32
    ring, alone = cp_saved(TINY, 2, 2 * s, 0, full=True), cp_saved(TINY, 1, s, full=True)
    assert _kept(ring) - _kept(alone) == collections.Counter({((1, s), "int64", 2 * s * 8): 1})
    assert _kept(alone) - _kept(ring) == collections.Counter({((1, s), "int64", s * 8): 1})
    full = ImplSpec(device="cuda", attention="sdpa", recompute="full")
    assert _activations(2, 2 * s, full) == _activations(1, s, full)
