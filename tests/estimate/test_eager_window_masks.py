"""Eager attention under recompute, in models with sliding and full blocks (Gemma-2, Gemma-3,
Qwen2 with upper sliding layers): the model builds one additive (B, 1, S, S) mask per layer type
(``create_causal_mask`` and ``create_sliding_window_causal_mask``; ``masking_utils.eager_mask``
materializes both, window reached or not), and each checkpoint holds its block's. The hf rules held
the causal mask alone: -4,096 B at B=2, S=32 in bf16 (2·32·32·2), now equal to the bytes a real
forward retains."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from trainmem.estimate.activations import activation_items  # noqa: E402
from trainmem.specs import ImplSpec, StepSpec  # noqa: E402
from trainmem.specs.loaders import spec_from_hf_config  # noqa: E402
# bytes a real bf16 forward makes and still holds when it returns, checkpoint regions included, with the
# ids and the loss (loss.value); parameters and buffers are not counted
from test_estimate_exact_defects import _retained  # noqa: E402

TINY = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128, vocab_size=500)
CONFIGS = {
    "gemma2": dict(model_type="gemma2", num_hidden_layers=4, head_dim=16, sliding_window=16, **TINY),
    "gemma3_text": dict(model_type="gemma3_text", num_hidden_layers=4, head_dim=16, sliding_window=16,
                        sliding_window_pattern=2, **TINY),
    "qwen2": dict(model_type="qwen2", num_hidden_layers=3, use_sliding_window=True, max_window_layers=1,
                  sliding_window=16, **TINY),
}
B = 2


def _estimated(cfg: dict, impl: ImplSpec, seq: int) -> tuple[int, list]:
    items = activation_items(spec_from_hf_config(cfg), StepSpec(batch=B, seq=seq, precision="bf16"), impl)
    # Gemma's 0-d embed_scale, a buffer autograd saves, is the buffer item: neither side counts it here
    return sum(i.bytes for i in items), items


def _masks(items: list) -> dict[str, int]:
    return {i.name: i.bytes for i in items if i.name.endswith("_mask")}


@pytest.mark.parametrize("family", ["gemma2", "qwen2"])
def test_full_recompute_holds_a_mask_per_layer_type(family):
    cfg, impl = CONFIGS[family], ImplSpec(attention="eager", device="cpu", recompute="full")
    estimated, items = _estimated(cfg, impl, 32)
    assert estimated == _retained(cfg, impl, seq=32)
    # 2·1·32·32·2 = 4,096 B each: the causal mask (full blocks) and the sliding one
    assert _masks(items) == {"model.causal_mask": 4096, "model.sliding_window_mask": 4096}


@pytest.mark.slow
@pytest.mark.parametrize("family,recompute,seq", [
    ("gemma2", "selective", 32), ("gemma2", "every-k", 32), ("gemma2", "full", 8),  # S < window: built too
    ("gemma3_text", "full", 32), ("gemma3_text", "every-k", 64), ("qwen2", "selective", 32)])
def test_eager_masks_equal_what_is_retained(family, recompute, seq):
    cfg = CONFIGS[family]
    impl = ImplSpec(attention="eager", device="cpu", recompute=recompute,
                    recompute_every=2 if recompute == "every-k" else 1)
    estimated, items = _estimated(cfg, impl, seq)
    assert estimated == _retained(cfg, impl, seq=seq)
    if recompute == "every-k":  # blocks 1 and 3 are checkpointed (torchtitan's count), both full: the sliding mask
        assert set(_masks(items)) == {"model.causal_mask"}  # is not held (blocks 0 and 2, sliding, before that fix)


def test_one_mask_when_every_block_slides():
    # Mistral builds one mask (create_sliding_window_causal_mask): its checkpoints hold it alone
    cfg = dict(model_type="mistral", num_hidden_layers=2, sliding_window=16, **TINY)
    items = activation_items(spec_from_hf_config(cfg), StepSpec(batch=B, seq=32, precision="bf16"),
                             ImplSpec(attention="eager", device="cpu", recompute="full"))
    assert _masks(items) == {"model.causal_mask": 4096}
