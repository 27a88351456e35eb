"""``--profile traced --tp N`` with a ``pad_token_id`` beyond one rank's vocabulary rows (OLMo-2: 100277 on
⌈100352/2⌉ = 50,176 rows; it failed with an internal error). The local fake embedding drops an out-of-range
``padding_idx`` (estimate/traced/tp.py ``_local_padding``): torch's TP keeps it on a global-size DTensor, and it
moves no byte (it zeroes one row of the weight's gradient in ``embedding_dense_backward``). So the padded model's
estimate equals the one without a pad token, to the byte, and ``padding_idx`` inside the shard is kept.
"""

from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")

from trainmem.estimate import estimate  # noqa: E402
from trainmem.estimate.traced.tp import _local_padding  # noqa: E402
from trainmem.specs import ImplSpec, ParallelSpec, StepSpec  # noqa: E402
from trainmem.specs.loaders import load_model  # noqa: E402

pytestmark = pytest.mark.usefixtures("traced_cache")
CFG = dict(model_type="llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
           num_key_value_heads=2, vocab_size=256)


def _estimate(tmp_path, cfg):
    path = tmp_path / f"{len(cfg)}.json"
    path.write_text(json.dumps(cfg))
    return estimate(load_model(str(path)), StepSpec(batch=1, seq=32, precision="bf16"),
                    ImplSpec(profile="traced", device="cpu"), parallel=ParallelSpec(tp=2))


def test_pad_token_beyond_the_local_shard_runs_and_moves_no_byte(tmp_path):
    padded = _estimate(tmp_path, {**CFG, "pad_token_id": 200})  # row 200 of 256: beyond rank 0's 128 rows
    plain = _estimate(tmp_path, CFG)
    assert padded.peak_bytes == plain.peak_bytes
    assert [(p.name, p.bytes) for p in padded.phases] == [(p.name, p.bytes) for p in plain.phases]


def test_local_padding_keeps_an_index_inside_the_shard():
    emb = torch.nn.Embedding(256, 8, padding_idx=100)
    emb.weight = torch.nn.Parameter(torch.empty(128, 8))
    _local_padding(emb)
    assert emb.padding_idx == 100
    emb.padding_idx = 200
    _local_padding(emb)
    assert emb.padding_idx is None
