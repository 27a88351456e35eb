"""torch's ring attention at the shape of one torchtitan Llama-3.1-405B 4-D rank (bench/published/cases.json,
``torchtitan-llama3.1-405b-4d-*``), with K/V as torchtitan's Llama hands them to SDPA: repeated to the query heads
(``repeat_kv`` in torchtitan/models/llama/model.py ``Attention.forward`` at 9dec370), so the ring carries
A/tp = 128/8 = 16 K/V heads, where transformers' Llama under trainmem's hf profile passes Akv/tp = 1 head
(``enable_gqa``). The step is torch 2.13's own ring on fake tensors (cp_flash_standin.py ``traced_ring_step``:
one block, hidden 2048 = 16 heads x hd 128, S/cp 32768, B 1, bf16, each block checkpointed), measured per ring
call against estimate/context_parallel.py's ``ring_forward_bytes`` / ``ring_backward_bytes``.

Measured, MiB (the most each call allocates above its entry; forward twice, the recompute too):
  cp 2 rank 0 forward 1,348, backward 3,265; rank 1 1,670 and 3,328
  cp 4 rank 0 1,922 and 3,968; rank 3 2,182 and 3,968
  cp 8 rank 0 2,946 and 4,992; ranks 6 and 7 3,206 and 4,992
the model's, to the byte. trainmem's hf profile counts 737 / 769 / 833 MiB (backward, 1 K/V head) at cp 2/4/8.
These are the numbers the 405B cases' notes weigh against the published growth (+0.6, +1.2, +7.8 GiB).
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

from trainmem.estimate.context_parallel import ring_backward_bytes, ring_forward_bytes  # noqa: E402

HEADS, HEAD_DIM, LOCAL_SEQ = 16, 128, 32768  # 405B per TP rank (128 heads / tp 8), S/cp in every 4-D row
RANK_405B = dict(model_type="llama", hidden_size=HEADS * HEAD_DIM, intermediate_size=256, num_hidden_layers=1,
                 num_attention_heads=HEADS, num_key_value_heads=HEADS, vocab_size=128,
                 max_position_embeddings=8 * LOCAL_SEQ)
MIB = 2**20


def _model(cp: int, rank: int) -> dict[str, int]:
    kw = dict(batch=1, heads=HEADS, kv_heads=HEADS, seq=LOCAL_SEQ, head_dim=HEAD_DIM, cp=cp, rank=rank, act_bytes=2)
    return {"forward": ring_forward_bytes(**kw), "backward": ring_backward_bytes(**kw)}


@pytest.mark.parametrize("cp,rank,forward_mib,backward_mib", [
    (8, 7, 3206, 4992),
    pytest.param(2, 0, 1348, 3265, marks=pytest.mark.slow), pytest.param(2, 1, 1670, 3328, marks=pytest.mark.slow),
    pytest.param(4, 0, 1922, 3968, marks=pytest.mark.slow), pytest.param(4, 3, 2182, 3968, marks=pytest.mark.slow),
    pytest.param(8, 0, 2946, 4992, marks=pytest.mark.slow)])
def test_ring_at_the_405b_rank_shape(cp, rank, forward_mib, backward_mib):
    _, calls = traced_ring_step(RANK_405B, cp, cp * LOCAL_SEQ, rank, 1, full=True)
    measured = {d: {m for name, m, _ in calls if name.endswith("_backward") == (d == "backward")}
                for d in ("forward", "backward")}
    model = _model(cp, rank)
    assert measured == {d: {b} for d, b in model.items()}
    assert model == {"forward": forward_mib * MIB, "backward": backward_mib * MIB}


def test_ring_growth_from_cp4_to_cp8_is_the_gathered_kv():
    """The worst rank's backward grows from cp 4 to cp 8 by the all-gathered K/V alone (``_AllGatherRotater``
    keeps cp chunks of K and V): (8 - 4) x 2 x 16 x 32768 x 128 x 2 B = 1,073,741,824 B, against the published
    +7.8 GiB between those rows."""
    worst = {cp: max(_model(cp, r)["backward"] for r in range(cp)) for cp in (4, 8)}
    assert worst[8] - worst[4] == (8 - 4) * 2 * HEADS * LOCAL_SEQ * HEAD_DIM * 2 == 1_073_741_824
