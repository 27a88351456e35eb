"""Inference KV cache of sliding-window blocks: at most the window, as transformers' DynamicCache
keeps it (cache_utils.py DynamicSlidingWindowLayer.update: the last W - 1 tokens, a view of
cat(kept, new), so W tokens of storage once a token is decoded, the whole prompt right after the
prefill). Checked against the storages of a real DynamicCache on CPU (tiny Mistral, window 16)."""

from __future__ import annotations

import json

import pytest

from trainmem.estimate.inference import inference_estimate
from trainmem.specs import StepSpec
from trainmem.specs.loaders import load_model

CFG = dict(model_type="mistral", hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
           num_key_value_heads=2, vocab_size=512, sliding_window=16)
B, PROMPT, DECODED = 2, 40, 3


def _estimate(tmp_path, cfg, context, prompt=PROMPT):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    return inference_estimate(load_model(str(path)), StepSpec(batch=B, seq=prompt, precision="fp32"),
                              context=context, block_size=1)


def _kv(e) -> int:
    return e.totals_bytes["kv_cache"]


def test_sliding_blocks_keep_the_window(tmp_path):
    full = _estimate(tmp_path, {**CFG, "sliding_window": None}, PROMPT + DECODED)
    win = _estimate(tmp_path, CFG, PROMPT + DECODED)
    per_token = 2 * B * 2 * 16 * 4  # K and V, B, kv heads, head_dim, fp32
    assert _kv(full) == 2 * (PROMPT + DECODED) * per_token
    assert _kv(win) == 2 * 16 * per_token
    prefill = next(p for p in win.phases if p.name == "prefill")
    assert prefill.parts["kv_cache"] + prefill.parts["kv_prompt_past_window"] == 2 * PROMPT * per_token
    short = _estimate(tmp_path, CFG, 12, prompt=8)  # inside the window: the whole context
    assert _kv(short) == 2 * 12 * per_token


torch = pytest.importorskip("torch")


@pytest.mark.slow  # ~3 s CPU: transformers' import and one tiny model build
def test_window_equals_a_real_dynamic_cache(tmp_path):
    from transformers import AutoConfig, AutoModelForCausalLM, DynamicCache

    hf = AutoConfig.for_model(**CFG)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(hf, attn_implementation="sdpa").eval()
    ids = torch.randint(0, CFG["vocab_size"], (B, PROMPT))

    def stored(cache) -> int:
        return sum(layer.keys.untyped_storage().nbytes() + layer.values.untyped_storage().nbytes()
                   for layer in cache.layers)

    with torch.no_grad():
        cache = DynamicCache(config=hf)
        out = model(ids, past_key_values=cache, use_cache=True)
        after_prefill = stored(cache)
        for _ in range(DECODED):
            out = model(out.logits[:, -1:].argmax(-1), past_key_values=cache, use_cache=True)
        after_decode = stored(cache)
    e = _estimate(tmp_path, CFG, PROMPT + DECODED)
    prefill = next(p for p in e.phases if p.name == "prefill")
    assert _kv(e) == after_decode
    assert prefill.parts["kv_cache"] + prefill.parts["kv_prompt_past_window"] == after_prefill
