"""The compiled saved set (``ImplSpec.compile``, ``estimate/rules_compiled.py``) against the trace of
the same step under torch.compile (``trace/compiled.py``: inductor's partition, no codegen)."""

import pytest

from trainmem.errors import UnsupportedError
from trainmem.estimate import estimate
from trainmem.estimate.activations import activation_items
from trainmem.estimate.symbols import evaluate
from trainmem.specs import ImplSpec, ParallelSpec, StepSpec
from trainmem.specs.loaders import spec_from_hf_config

LLAMA = dict(model_type="llama", hidden_size=64, intermediate_size=176, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=4, vocab_size=1000, max_position_embeddings=256)
QWEN2 = dict(model_type="qwen2", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, vocab_size=1000, max_position_embeddings=256)
COMPILED = ImplSpec(device="cpu", compile=True)
INV_FREQ = 16 // 2 * 4  # LLAMA's and QWEN2's rotary inv_freq: hd/2 fp32, hd = 16


def _autograd_saved(items):
    """The compiled graph's saved set: the items less the fp32 loss it returns to the caller
    (``lm_head.loss.value``, 4 B, not saved: estimate/loss_value.py)."""
    assert [(i.dtype, i.bytes) for i in items if i.name.endswith("loss.value")] == [("float32", 4)]
    return [i for i in items if not i.name.endswith("loss.value")]


def _saved(config, precision, batch=2, seq=64):
    items = _autograd_saved(activation_items(spec_from_hf_config(config),
                                             StepSpec(batch=batch, seq=seq, precision=precision), COMPILED))
    return sum(i.bytes for i in items), len(items), items


def test_llama_fp32_exact():
    # B=2, S=64, H=64, F=176, A=4, hd=16, V=1000, 2 layers, fp32 (tests/trace/test_compiled.py):
    # per layer 8*B*S*H*4 + 3*B*S*F*4 + 2*B*S*4 + B*A*S*4 = 262144 + 270336 + 1024 + 2048 = 535552
    # final 2*B*S*H*4 + B*S*4 + B*S*V*4 + 2*B*S*4 + 4 = 65536 + 512 + 512000 + 1024 + 4 = 579076
    # ids B*S*8 = 1024, labels B*(S+1)*8 = 1040; the graph also saves inv_freq (hd/2*4 = 32), the rotary
    # buffer itself: the buffer ledger (estimate/buffers.py), not an activation
    assert _saved(LLAMA, "fp32")[:2] == (2 * 535552 + 579076 + 1024 + 1040, 37)  # 1652244


def test_llama_bf16_exact():
    # the B*S*H, B*S*F and logits tensors in 2 bytes; rsqrt, lse, row max and log-sum-exp stay fp32:
    # per layer 262144/2 + 270336/2 + 1024 + 2048 = 269312; final 32768 + 512 + 256000 + 1024 + 4 = 290308
    assert _saved(LLAMA, "bf16")[:2] == (2 * 269312 + 290308 + 1024 + 1040, 37)  # 830996


def test_qwen2_gqa_and_biases_exact():
    # Akv=2 K/V heads: K and V are B*S*Akv*hd*4 = 16384; F=128: B*S*F*4 = 65536; biases keep nothing
    # per layer 6*32768 + 2*16384 + 3*65536 + 1024 + 2048 = 429056; final 579076 as for Llama
    assert _saved(QWEN2, "fp32")[:2] == (2 * 429056 + 579076 + 1024 + 1040, 37)  # 1439252


FULL = ImplSpec(device="cpu", compile=True, recompute="full")


def _saved_full(config, precision, batch=2, seq=64):
    items = _autograd_saved(activation_items(spec_from_hf_config(config),
                                             StepSpec(batch=batch, seq=seq, precision=precision), FULL))
    return sum(i.bytes for i in items), len(items)


def test_llama_full_recompute_keeps_block_inputs_and_the_mask():
    # B=2, S=64, H=64, V=1000, 2 layers, fp32: ids 1024, block inputs 2 x B*S*H*4 = 65536 (inv_freq: a buffer),
    # the materialized causal mask B*1*S*S*4 = 32768, final rsqrt B*S*4 = 512 and norm output 32768,
    # logits B*S*V*4 = 512000, labels B*(S+1)*8 = 1040, row max and log-sum-exp 2 x 512, count 4
    assert _saved_full(LLAMA, "fp32") == (1024 + 65536 + 32768 + 512 + 32768 + 512000 + 1040 + 1024 + 4, 11)
    # bf16, B=3, S=40: ids 960, block inputs 2 x 15360, mask 3*40*40*2 = 9600, rsqrt 480,
    # norm output 15360, logits 240000, labels 3*41*8 = 984, row stats 2 x 480, count 4
    assert _saved_full(LLAMA, "bf16", 3, 40) == (960 + 30720 + 9600 + 480 + 15360 + 240000 + 984 + 960 + 4, 11)


def test_formulas_evaluate_to_the_bytes():
    _, _, items = _saved(QWEN2, "bf16", batch=3, seq=50)
    env = dict(B=3, S=50, H=64, F=128, A=4, Akv=2, hd=16, V=1000)
    for it in items:
        assert tuple(evaluate(d, env) for d in it.dims) == it.shape, it.name
        assert evaluate(it.formula, env) == it.bytes, it.name


def test_compile_saves_less_than_eager_in_the_estimate_too():
    m, step = spec_from_hf_config(LLAMA), StepSpec(batch=2, seq=64, precision="fp32")
    eager = estimate(m, step, ImplSpec(device="cpu"))
    compiled = estimate(m, step, COMPILED)
    # the saved set (test_llama_fp32_exact) and the loss the caller holds (loss.value, 4 B)
    assert compiled.totals_bytes["activation"] == 1652244 + 4 < eager.totals_bytes["activation"]
    assert compiled.totals_bytes["buffer"] == eager.totals_bytes["buffer"] == 64  # inv_freq + original_inv_freq


@pytest.mark.parametrize("impl,parallel,why", [
    # eager attention is modelled at --recompute none (estimate/rules_compiled_attention.py)
    (ImplSpec(compile=True, attention="eager", recompute="full"), None, "attention='eager'"),
    (ImplSpec(compile=True, recompute="op"), None, "recompute='op'"),
    (ImplSpec(compile=True), ParallelSpec(tp=2), "parallel"),
])
def test_unchecked_settings_are_refused_by_name(impl, parallel, why):
    with pytest.raises(UnsupportedError, match=why) as info:
        estimate(spec_from_hf_config(LLAMA), StepSpec(batch=2, seq=64, precision="bf16"), impl, parallel)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("config", [
    dict(model_type="gpt_neox", hidden_size=64, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
         vocab_size=1000, max_position_embeddings=256),  # GPT-2 has its own: tests/estimate/test_compiled_gpt2.py
    dict(LLAMA, model_type="mistral", sliding_window=32),  # the window changes the compiled set
])
def test_other_families_are_refused_by_name(config):
    with pytest.raises(UnsupportedError, match=f"model='{config['model_type']}'"):
        estimate(spec_from_hf_config(config), StepSpec(batch=2, seq=64, precision="fp32"), COMPILED)


@pytest.mark.slow
@pytest.mark.parametrize("config,precision,batch,seq", [(QWEN2, "fp32", 1, 96), (LLAMA, "bf16", 3, 40)])
def test_estimate_equals_the_compiled_trace(config, precision, batch, seq):
    pytest.importorskip("torch")
    from trainmem.trace import trace_step

    step = StepSpec(batch=batch, seq=seq, precision=precision)
    traced = trace_step(config, step, COMPILED).meta["compile"]
    # the graph's saved set holds the rotary inv_freq buffer itself (hd/2 fp32): the buffer ledger here
    assert _saved(config, precision, batch, seq)[:2] == (traced["saved_compiled_bytes"] - INV_FREQ,
                                                         traced["saved_compiled_tensors"] - 1)


def test_the_text_header_says_compile():
    from trainmem.report.text import render_estimate

    e = estimate(spec_from_hf_config(LLAMA), StepSpec(batch=2, seq=64, precision="bf16"), COMPILED)
    line = next(l for l in render_estimate(e).splitlines() if l.startswith("implementation:"))
    assert line.endswith("torch.compile (saved set: docs/compile.md)")


@pytest.mark.slow
@pytest.mark.parametrize("config,precision,batch,seq", [(LLAMA, "fp32", 2, 64), (QWEN2, "bf16", 3, 40)])
def test_full_recompute_estimate_equals_the_compiled_trace(config, precision, batch, seq):
    pytest.importorskip("torch")
    from trainmem.trace import trace_step

    traced = trace_step(config, StepSpec(batch=batch, seq=seq, precision=precision), FULL).meta["compile"]
    # autograd also keeps one CPU generator state per block (torch.get_rng_state(), 5056 bytes of host
    # memory, for the recomputed SDPA: trace/compiled.py _save_rng_state), which the estimate leaves out
    layers = config["num_hidden_layers"]
    # and the rotary inv_freq buffer (the buffer ledger), as above
    assert _saved_full(config, precision, batch, seq) == (traced["saved_compiled_bytes"] - layers * 5056 - INV_FREQ,
                                                          traced["saved_compiled_tensors"] - layers - 1)
