"""Gemma-2 under torch.compile per block: eager attention (transformers' Gemma-2 has no SDPA path) with tanh
soft-capping of the scores inside each compiled block, the capped logits in the eager head
(``estimate/rules_compiled_attention.py``, ``rules_compiled.py``), against the compiled trace."""

from __future__ import annotations

import pytest

from trainmem.errors import UnsupportedError
from trainmem.estimate import estimate
from trainmem.estimate.activations import activation_items
from trainmem.specs import ImplSpec, StepSpec
from trainmem.specs.loaders import spec_from_hf_config

# Gemma2Config's soft-capping (50 on the scores, 30 on the logits); a sliding and a full block, window 512 >= S
GEMMA2 = dict(model_type="gemma2", hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, vocab_size=1000, max_position_embeddings=256, sliding_window=512)
BF16 = StepSpec(batch=2, seq=64, precision="bf16")


def _saved(impl, step=BF16):
    """Autograd's saved set: the items less the fp32 loss the caller holds (``loss.value``, 4 B)."""
    items = [i for i in activation_items(spec_from_hf_config(GEMMA2), step, impl) if not i.name.endswith("loss.value")]
    return sum(i.bytes for i in items), len(items)


def test_gemma2_per_block_exact():
    # per block (19 tensors), B=2 S=64 H=64 A=4 Akv=2 hd=16 F=176 bf16: the compiled eager attention (q, the
    # repeated K and V, the output 4 x 16384, scores and probabilities 2 x 65536, row max and sum 2 x 2048; the
    # capped scores are recomputed from the scores), the input, input norm's output, o_proj's and down_proj's outputs
    # and the pre-feedforward norm's output 5 x 16384, four rsqrt 4 x 512, gate, up, act·up 3 x 45056
    block = 9 * 16384 + 2 * 65536 + 2 * 2048 + 4 * 512 + 3 * 45056
    # around the blocks: ids 1024, cos/sin 2 x 2048, one eager mask per layer type 2 x 16384, Gemma's final norm
    # (fp32 input and normed product 2 x 32768, rsqrt 512, 1 + w 256, output 16384), the eager capped logits' tanh
    # 256000, the fp32 log_softmax 512000, targets 1024, count 4 (15 tensors)
    head = 1024 + 4096 + 2 * 16384 + 2 * 32768 + 512 + 256 + 16384 + 256000 + 512000 + 1024 + 4
    impl = ImplSpec(device="cpu", compile=True, compile_scope="block", attention="eager")
    assert _saved(impl) == (2 * block + head, 2 * 19 + 16)  # 1729284: the trace less embed_scale (2 B)


@pytest.mark.parametrize("impl", [
    # whole model: the min-cut also keeps each block's residual sum and, in later blocks, the capped scores
    ImplSpec(device="cpu", compile=True, attention="eager"),
    ImplSpec(device="cpu", compile=True, compile_scope="block", attention="flash"),  # not traced (no CPU flash)
])
def test_unchecked_gemma2_settings_are_refused(impl):
    with pytest.raises(UnsupportedError) as info:
        estimate(spec_from_hf_config(GEMMA2), BF16, impl)
    assert "\n" not in str(info.value) and "compile" in str(info.value)


@pytest.mark.slow
@pytest.mark.parametrize("scope, batch, seq", [("block", 1, 96), ("block-loss", 3, 40)])
def test_estimate_equals_the_compiled_trace(scope, batch, seq):
    pytest.importorskip("torch")
    from trainmem.trace import trace_step

    impl = ImplSpec(device="cpu", compile=True, compile_scope=scope, attention="eager")
    step = StepSpec(batch=batch, seq=seq, precision="bf16")
    traced = trace_step(GEMMA2, step, impl).meta["compile"]
    # the graphs save the scaled embedding's 0-d embed_scale (bf16, 2 B), a buffer (estimate/buffers.py)
    assert _saved(impl, step) == (traced["saved_compiled_bytes"] - 2, traced["saved_compiled_tensors"] - 1)
