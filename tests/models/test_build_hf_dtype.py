"""``build_hf_model(dtype=...)`` builds as ``from_pretrained(dtype=...)`` loads: under the dtype as the
default (transformers 5.24 ``modeling_utils.PreTrainedModel._from_config`` / ``get_init_context``:
``local_torch_dtype``), not ``model.to(dtype)``, which would cast RoPE's fp32 ``inv_freq`` too. So
the buffers the measurement holds (``measure_dist/worker.py``: ``storage_bytes(model.buffers())``)
are the estimate's buffer ledger, name for name (tiny Llama bf16: 64 B, was 32 B)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from trainmem.estimate.buffers import buffer_items  # noqa: E402
from trainmem.measure_dist.tracking import storage_bytes  # noqa: E402
from trainmem.models.hf import build_hf_model  # noqa: E402
from trainmem.specs import StepSpec  # noqa: E402
from trainmem.specs.loaders import spec_from_hf_config  # noqa: E402

LLAMA = dict(model_type="llama", hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=256)


def test_bf16_build_keeps_rope_fp32_and_equals_the_buffer_ledger():
    model = build_hf_model(LLAMA, dtype=torch.bfloat16, init_weights=False)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    real = {n: (tuple(b.shape), str(b.dtype).removeprefix("torch."), b.untyped_storage().nbytes())
            for n, b in model.named_buffers()}
    declared = {i.name: (i.shape, i.dtype, i.bytes)
                for i in buffer_items(spec_from_hf_config(LLAMA), StepSpec(batch=1, seq=16, precision="bf16"))}
    assert real == declared == {"model.rotary_emb.inv_freq": ((8,), "float32", 32),
                                "model.rotary_emb.original_inv_freq": ((8,), "float32", 32)}
    assert storage_bytes(model.buffers()) == sum(b for *_, b in declared.values()) == 64
    assert torch.get_default_dtype() == torch.float32  # the build's default dtype is restored
