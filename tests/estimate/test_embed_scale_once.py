"""Gemma's ``embed_scale`` (a registered 0-d buffer, ``GemmaTextScaledWordEmbedding``) is counted
once: as the buffer item, as ``trainmem trace`` files it (``trace/model_states.py`` ``register_states``:
every ``named_buffers()`` tensor is a buffer). Autograd saves the buffer itself
(``* self.embed_scale.to(self.weight.dtype)`` makes no copy in the model's dtype), so the hf rules
and ``--profile traced`` do not count it as an activation too (they did: 2-4 B twice). The
activations against autograd, less saved buffers: ``kinds_configs.check_against_autograd``."""

from __future__ import annotations

import pytest

from trainmem.estimate import estimate
from trainmem.inventory import Category
from trainmem.specs import ImplSpec, StepSpec
from trainmem.specs.loaders import spec_from_hf_config

TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=512, head_dim=16)


@pytest.mark.parametrize("family", ["gemma", "gemma2", "gemma3_text"])
@pytest.mark.parametrize("precision,size", [("fp32", 4), ("bf16", 2)])
def test_embed_scale_is_one_buffer_item(family, precision, size):
    spec = spec_from_hf_config({**TINY, "model_type": family})
    e = estimate(spec, StepSpec(batch=2, seq=32, precision=precision), ImplSpec(device="cpu", attention="eager"))
    found = [(i.category, i.bytes) for i in e.inventory.items if i.name.endswith("embed_scale")]
    assert found == [(Category.BUFFER, size)]
