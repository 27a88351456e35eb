"""Interleaved 1F1B with an uneven split: --layer-split gives each rank's layers over all its
virtual stages (torchtitan's generate_split_points splits Llama 3.1 405B's 126 layers over 16
stages as 7, 8 x 14, 7: ranks hold 15, 16 x 6, 15)."""

from __future__ import annotations

import pytest

from trainmem.errors import SpecError
from trainmem.estimate import estimate
from trainmem.specs import ImplSpec, ParallelSpec, StepSpec
from trainmem.specs.loaders import spec_from_hf_config

CFG = dict(model_type="llama", hidden_size=64, intermediate_size=176, num_hidden_layers=6, num_attention_heads=4,
           num_key_value_heads=2, vocab_size=500)


def _par(**kw) -> ParallelSpec:
    return ParallelSpec(pp=2, schedule="interleaved", virtual_stages=2, microbatches=4, **kw)


def test_uneven_interleaved_needs_a_split_and_follows_it():
    spec, step, impl = spec_from_hf_config(CFG), StepSpec(batch=4, seq=32, precision="bf16"), ImplSpec()
    with pytest.raises(SpecError, match="virtual_stages"):  # 6 layers over 2 x 2 stages
        estimate(spec, step, impl, _par())
    three = estimate(spec, step, impl, _par(layer_split=(3, 3)))
    four = estimate(spec, step, impl, _par(layer_split=(4, 2)))
    assert len(three.ranks) == len(four.ranks) == 2
    # the first rank's share grows with its layers
    assert four.ranks[0].peak_bytes > three.ranks[0].peak_bytes
