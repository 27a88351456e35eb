"""``--compile --attention eager`` (``estimate/rules_compiled_attention.py``): what a compiled block keeps
of transformers' eager attention, against the compiled trace."""

from __future__ import annotations

import pytest

from trainmem.errors import UnsupportedError
from trainmem.estimate import estimate
from trainmem.estimate.activations import activation_items
from trainmem.specs import ImplSpec, StepSpec
from trainmem.specs.loaders import spec_from_hf_config

LLAMA = dict(model_type="llama", hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=1000, max_position_embeddings=256)
QWEN2 = dict(LLAMA, model_type="qwen2")  # q/k/v biases
BF16 = StepSpec(batch=2, seq=64, precision="bf16")


def _saved(config, impl, step=BF16):
    """Autograd's saved set: the items less the fp32 loss the caller holds (``loss.value``, 4 B)."""
    items = [i for i in activation_items(spec_from_hf_config(config), step, impl) if not i.name.endswith("loss.value")]
    return sum(i.bytes for i in items), len(items)


# B=2, S=64, H=64, A=4, Akv=2, hd=16, F=176, bf16, per block (17 tensors): the input, both norms' outputs and
# o_proj's output 4 x 16384, two rsqrt 2 x 512, q, the repeated K and V and the attention output 4 x 2*4*64*16*2 =
# 4 x 16384, the scores and the 16-bit probabilities 2 x 2*4*64*64*2 = 2 x 65536, the softmax's fp32 row max and
# sum 2 x 2*4*64*4 = 2 x 2048, gate, up, act·up 3 x 45056
BLOCK = 8 * 16384 + 2 * 512 + 2 * 65536 + 2 * 2048 + 3 * 45056


def test_compiled_eager_attention_exact():
    # per block: around the blocks the eager head (ids 1024, cos/sin 2 x 2048, final norm 32768 + 512 + 2 x
    # 16384, fp32 log_softmax 512000, targets 1024, count 4) and the eager causal mask 2*1*64*64*2 = 16384
    head = 1024 + 4096 + 32768 + 512 + 32768 + 512000 + 1024 + 4 + 16384
    block = ImplSpec(device="cpu", compile=True, compile_scope="block", attention="eager")
    assert _saved(LLAMA, block) == (2 * BLOCK + head, 2 * 17 + 11)  # 1405444, the trace's
    # whole model: no mask (rebuilt from iota in the graph); the final norm's input, rsqrt, output 2 x 16384 + 512,
    # the logits 256000, row max and log-sum-exp 2 x 512, labels padded 1040, count 4, ids 1024
    head = 2 * 16384 + 512 + 256000 + 1024 + 1040 + 4 + 1024
    whole = ImplSpec(device="cpu", compile=True, attention="eager")
    assert _saved(LLAMA, whole) == (2 * BLOCK + head, 43)  # 1097236: the trace less inv_freq (32 B)


def test_compiled_eager_attention_fp32_exact():
    # fp32 keeps the softmax's output (the second bmm's input) and neither the scores, the reductions nor the mask;
    # per block (14 tensors): input, norm outputs, o_proj, q, K, V, attention output 8 x 32768, rsqrt 2 x 512, the
    # probabilities 2*4*64*64*4 = 131072, gate, up, act·up 3 x 90112; around them ids 1024, cos/sin 2 x 4096, the
    # final norm's input, normed product and output 3 x 32768, rsqrt 512, log_softmax 512000, targets 1024, count 4
    block = 8 * 32768 + 2 * 512 + 131072 + 3 * 90112
    head = 1024 + 8192 + 3 * 32768 + 512 + 512000 + 1024 + 4
    impl = ImplSpec(device="cpu", compile=True, compile_scope="block", attention="eager")
    assert _saved(LLAMA, impl, StepSpec(batch=2, seq=64, precision="fp32")) == (2 * block + head, 38)  # 1950212


@pytest.mark.parametrize("config, precision, impl", [
    (LLAMA, "fp16", ImplSpec(device="cpu", compile=True, attention="eager")),  # not traced
    (dict(LLAMA, num_key_value_heads=1), "bf16", ImplSpec(device="cpu", compile=True, attention="eager")),
])
def test_unchecked_eager_attention_is_refused_by_name(config, precision, impl):
    with pytest.raises(UnsupportedError, match="attention='eager'") as info:
        estimate(spec_from_hf_config(config), StepSpec(batch=2, seq=64, precision=precision), impl)
    assert "\n" not in str(info.value)


@pytest.mark.slow
@pytest.mark.parametrize("config, scope, batch, seq, precision", [
    (LLAMA, "model", 1, 96, "bf16"), (LLAMA, "block-loss", 3, 40, "bf16"), (QWEN2, "block", 2, 48, "bf16"),
    (LLAMA, "model", 2, 48, "fp32"), (dict(LLAMA, num_key_value_heads=4), "block", 2, 40, "bf16")])
def test_estimate_equals_the_compiled_trace(config, scope, batch, seq, precision):
    pytest.importorskip("torch")
    from trainmem.trace import trace_step

    impl = ImplSpec(device="cpu", compile=True, compile_scope=scope, attention="eager")
    step = StepSpec(batch=batch, seq=seq, precision=precision)
    traced = trace_step(config, step, impl).meta["compile"]
    inv_freq = [32] if scope == "model" else []  # the whole-model graph saves the rotary inv_freq, a buffer
    assert _saved(config, impl, step) == (traced["saved_compiled_bytes"] - sum(inv_freq),
                                          traced["saved_compiled_tensors"] - len(inv_freq))
