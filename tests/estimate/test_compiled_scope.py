"""``--compile-scope block`` (``ImplSpec.compile_scope``): each decoder block compiled alone, as
torchtitan's ``apply_compile`` and torchtune's ``compile_model`` do; the embedding, rotary table,
final norm, head and loss eager (``estimate/rules_compiled.py`` ``_per_block``, traced by
``trace/compiled.py`` ``_compile_blocks``)."""

import pytest

from trainmem.errors import SpecError, UnsupportedError
from trainmem.estimate import estimate
from trainmem.estimate.activations import activation_items
from trainmem.specs import ImplSpec, StepSpec
from trainmem.specs.loaders import spec_from_hf_config

LLAMA = dict(model_type="llama", hidden_size=64, intermediate_size=176, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=4, vocab_size=1000, max_position_embeddings=256)
QWEN2 = dict(model_type="qwen2", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, vocab_size=1000, max_position_embeddings=256)
BLOCK = ImplSpec(device="cpu", compile=True, compile_scope="block")
FULL = ImplSpec(device="cpu", compile=True, compile_scope="block", recompute="full")


def _saved(config, precision, impl=BLOCK, batch=2, seq=64):
    """Autograd's saved set: the items less the fp32 loss the caller holds (``loss.value``, 4 B, not saved:
    estimate/loss_value.py), which every loss path here has."""
    items = activation_items(spec_from_hf_config(config), StepSpec(batch=batch, seq=seq, precision=precision), impl)
    value = [(i.dtype, i.bytes) for i in items if i.name.endswith("loss.value")]  # lm_head.loss.value: whole model
    assert value == [("float32", 4)]
    items = [i for i in items if not i.name.endswith("loss.value")]
    return sum(i.bytes for i in items), len(items)


def test_llama_fp32_per_block_exact():
    # B=2, S=64, H=64, F=176, A=4, hd=16, V=1000, 2 layers, fp32. Each block keeps what it keeps in the
    # whole-model region (test_compiled_rules.py): 8*B*S*H*4 + 3*B*S*F*4 + 2*B*S*4 + B*A*S*4 = 535552.
    # Eager around them: ids B*S*8 = 1024; the rotary cos and sin, block inputs, 2 x S*hd*4 = 8192
    # (no inv_freq); the final RMSNorm keeps its input, rsqrt and normed product (32768 + 512 + 32768),
    # lm_head its input (32768), the loss the fp32 log_softmax B*S*V*4 = 512000, the shifted targets
    # B*S*8 = 1024 and the count 4 (no padded labels, no row max / log-sum-exp)
    head = 32768 + 512 + 32768 + 32768 + 512000 + 1024 + 4
    assert _saved(LLAMA, "fp32") == (2 * 535552 + 1024 + 8192 + head, 38)  # 1692164 (trace: test_compiled_blocks.py)
    # whole model: 39920 fewer (its inv_freq, saved too, is the buffer: estimate/buffers.py)
    assert _saved(LLAMA, "fp32", ImplSpec(device="cpu", compile=True)) == (1652244, 37)


def test_llama_bf16_per_block_exact():
    # per block 269312 (test_compiled_rules.py); cos, sin in bf16 2 x 2048; the eager norm keeps the
    # fp32 copy of its input 32768, rsqrt 512, the bf16 normed 16384; lm_head's input 16384; the loss
    # upcasts: fp32 log_softmax 512000, targets 1024, count 4
    head = 32768 + 512 + 16384 + 16384 + 512000 + 1024 + 4
    assert _saved(LLAMA, "bf16") == (2 * 269312 + 1024 + 4096 + head, 38)  # 1122820


def test_llama_bf16_blocks_and_loss_exact():
    # block-loss (torchtune's compile_model + compile_loss): the blocks and the eager norm as above; the
    # eager lm_head keeps its input (16384) and the loss, compiled alone, the bf16 logits B*S*V*2 = 256000
    # (its input), row max and log-sum-exp 2 x B*S*4, the labels padded to S+1 B*65*8 = 1040, count 4
    head = 32768 + 512 + 16384 + 16384 + 256000 + 512 + 512 + 1040 + 4
    impl = ImplSpec(device="cpu", compile=True, compile_scope="block-loss")
    assert _saved(LLAMA, "bf16", impl) == (2 * 269312 + 1024 + 4096 + head, 40)  # 867860 (the real step's too)


def test_llama_amp_bf16_per_block_exact():
    # amp-bf16 (fp32 weights, CPU autocast to bf16) per block: the block input stays fp32 (B*S*H*4 = 32768),
    # rsqrt fp32 2 x 512, lse 2048; the two norms' outputs (the linears' bf16 inputs), roped q and k, v,
    # the SDPA and o_proj outputs 7 x B*S*H*2 = 7 x 16384; gate, up, act*up 3 x B*S*F*2 = 3 x 45056; and
    # autocast's bf16 weight copies, which the backward's mms read: 4 x H*H*2 + 3 x F*H*2 = 32768 + 67584
    block = 32768 + 2 * 512 + 2048 + 7 * 16384 + 3 * 45056 + 4 * 8192 + 3 * 22528  # 388096
    # eager: ids 1024, fp32 cos/sin 2 x 4096; the final norm keeps its input (fp32 already: no copy),
    # rsqrt and the fp32 normed product 32768 + 512 + 32768, lm_head its bf16 input and weight copies
    # 16384 + V*H*2 = 128000, the loss the fp32 log_softmax 512000, targets 1024, count 4
    head = 32768 + 512 + 32768 + 16384 + 128000 + 512000 + 1024 + 4
    assert _saved(LLAMA, "amp-bf16") == (2 * block + 1024 + 8192 + head, 53)  # 1504772, the trace's too
    with pytest.raises(UnsupportedError, match="precision='amp-bf16'"):  # whole-model: not modelled
        _saved(LLAMA, "amp-bf16", ImplSpec(device="cpu", compile=True))


def test_llama_full_recompute_per_block_exact():
    # torchtitan's order (checkpoint inside each compiled block): each block keeps its input, 2 x B*S*H*4;
    # ids 1024, cos and sin 8192 and the eager head and loss as above; autograd also keeps one CPU
    # generator state (5056 bytes, host memory) per block, left out as under whole-model compile
    head = 32768 + 512 + 32768 + 32768 + 512000 + 1024 + 4
    assert _saved(LLAMA, "fp32", FULL) == (2 * 32768 + 1024 + 8192 + head, 12)  # 686596


LORA = dict(mode="lora", lora_rank=8, lora_alpha=16, lora_targets=("q_proj", "v_proj"), adapter_dtype="param")
TORCHTUNE_FULL = ImplSpec(device="cpu", compile=True, compile_scope="block-loss", recompute="full")


def _lora_saved(impl, precision="bf16", batch=2, seq=64, config=LLAMA):
    from trainmem.specs.finetune import FinetuneSpec

    items = activation_items(spec_from_hf_config(config), StepSpec(batch=batch, seq=seq, precision=precision), impl,
                             finetune=FinetuneSpec(**LORA))
    items = [i for i in items if not i.name.endswith("loss.value")]  # the loss the caller holds: not saved (as _saved)
    return sum(i.bytes for i in items), sum(1 for i in items if i.bytes)


def test_lora_with_full_recompute_per_block_exact():
    # torchtune's LoRA recipes (blocks and loss compiled, full checkpointing): the blocks keep their inputs
    # (the frozen embedding's output requires grad: transformers' enable_input_require_grads), 2 x B*S*H*2;
    # cos, sin 2 x 2048; the frozen final norm keeps its fp32 input copy 32768 and rsqrt 512 (not the
    # normed product: no weight gradient); the frozen lm_head keeps nothing; the compiled loss the bf16
    # logits 256000, row stats 2 x 512, padded labels 1040, count 4. The adapters are recomputed
    assert _lora_saved(TORCHTUNE_FULL) == (2 * 16384 + 4096 + 32768 + 512 + 256000 + 1024 + 1040 + 4, 11)  # 328212


@pytest.mark.parametrize("impl", [ImplSpec(device="cpu", compile=True, compile_scope="block-loss"),
                                  ImplSpec(device="cpu", compile=True, recompute="full")])
def test_lora_elsewhere_is_refused_in_one_line(impl):
    with pytest.raises(UnsupportedError, match="finetune='lora'") as info:
        _lora_saved(impl)
    assert "\n" not in str(info.value)


MISTRAL = dict(model_type="mistral", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, vocab_size=1000, max_position_embeddings=256,
               sliding_window=256)


def test_mistral_with_a_window_not_shorter_than_s_is_qwen2_without_biases():
    # window 256 >= S = 64: transformers passes SDPA no mask (masking_utils), so the compiled blocks are
    # Llama's with grouped K/V heads: Qwen2's tiny shapes, whose biases keep nothing (test_compiled_rules.py)
    for impl in (ImplSpec(device="cpu", compile=True), BLOCK):
        assert _saved(MISTRAL, "bf16", impl) == _saved(QWEN2, "bf16", impl)
    # the trace's saved set less the inv_freq buffer (32 B, one tensor) the whole-model graph saves
    assert _saved(MISTRAL, "bf16", ImplSpec(device="cpu", compile=True)) == (724500, 37)
    with pytest.raises(UnsupportedError, match="model='mistral'.*no sliding window shorter than S"):
        _saved(dict(MISTRAL, sliding_window=32), "bf16")


QWEN3 = dict(model_type="qwen3", hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, vocab_size=1000, max_position_embeddings=256)


def test_qwen3_q_k_norms_exact():
    # B=2, S=64, H=64, F=128, A=4, Akv=2, hd=16, bf16, per block. Qwen2's set without biases
    # (test_compiled_rules.py: 6 x B*S*H*2 + 2 x B*S*Akv*hd*2 + 3 x B*S*F*2 + rsqrt 2 x 512 + lse 2048,
    # the block input included) plus what the per-head q/k RMSNorms keep: the q and k projections'
    # outputs (B*S*A*hd*2 = 16384, B*S*Akv*hd*2 = 8192) and their fp32 rsqrt per head (B*S*A*4 = 2048,
    # B*S*Akv*4 = 1024)
    block = 6 * 16384 + 2 * 8192 + 3 * 32768 + 2 * 512 + 2048 + 16384 + 8192 + 2048 + 1024  # 243712
    head = 32768 + 512 + 16384 + 16384 + 512000 + 1024 + 4  # eager, as test_llama_bf16_per_block_exact
    assert _saved(QWEN3, "bf16") == (2 * block + 1024 + 4096 + head, 46)  # 1071620, the trace's too


def test_the_family_set_is_the_registry_s():
    from trainmem.estimate.rules_compiled import compiled_families
    from trainmem.families import families

    assert {"llama", "qwen2", "qwen3", "mistral"} <= set(compiled_families())
    assert set(compiled_families()) == {f.name for f in families() if f.compiled_rules}


def test_scope_is_validated():
    with pytest.raises(SpecError, match="compile_scope"):
        ImplSpec(compile=True, compile_scope="layer")
    assert ImplSpec(compile=True, compile_scope="block-loss").compile_words() == (
        " torch.compile per block and loss (saved set: docs/compile.md)")
    with pytest.raises(SpecError, match="compile_scope='block'.*needs compile=True"):
        ImplSpec(compile_scope="block")


def test_header_says_per_block():
    from trainmem.report.text import render_estimate

    e = estimate(spec_from_hf_config(LLAMA), StepSpec(batch=2, seq=64, precision="bf16"), BLOCK)
    line = next(l for l in render_estimate(e).splitlines() if l.startswith("implementation:"))
    assert line.endswith("torch.compile per block (saved set: docs/compile.md)")


def test_cli_flag_reaches_the_spec():
    import argparse

    from trainmem.cliargs import add_compile_arg

    p = argparse.ArgumentParser()
    add_compile_arg(p)
    assert p.parse_args(["--compile", "--compile-scope", "block"]).compile_scope == "block"
    assert p.parse_args([]).compile_scope == "model"
    with pytest.raises(SystemExit):
        p.parse_args(["--compile-scope", "layer"])


def test_trace_line_names_the_scope():
    pytest.importorskip("torch")
    from trainmem.trace.cli import compile_line

    c = {"backend": "trainmem_partition", "regions": 2, "saved_eager_bytes": 2003460, "saved_eager_tensors": 44,
         "saved_compiled_bytes": 1692164, "saved_compiled_tensors": 38, "scope": "block"}
    # 2003460 / 2**20 = 1.91, 1692164 / 2**20 = 1.61 (the tiny Llama fp32 per block)
    assert compile_line(c) == ("saved for backward: eager 1.91 MiB (44 tensors), compiled 1.61 MiB (38 tensors) "
                               "in 2 region(s) (blocks compiled alone), backend trainmem_partition")


def test_llama_op_recompute_per_block_on_cpu_exact():
    # torchtitan's op-level policy inside each compiled block (CPU: the SDPA kernel is not on its list):
    # the block keeps its input and the kept mm outputs its backward reads, q (1st mm), v (3rd) and gate
    # (5th), not down_proj's (7th): per block 3 x B*S*H*2 + B*S*F*2 = 49152 + 45056; plus a CPU generator
    # state per block in the trace (host memory, left out). ids 1024, cos/sin 4096, the eager head 579076
    impl = ImplSpec(device="cpu", compile=True, compile_scope="block", recompute="op")
    head = 32768 + 512 + 16384 + 16384 + 512000 + 1024 + 4
    assert _saved(LLAMA, "bf16", impl) == (2 * (49152 + 45056) + 1024 + 4096 + head, 18)  # 772612


def test_unmodelled_recompute_is_refused_in_one_line():
    impl = ImplSpec(compile=True, compile_scope="model", recompute="op")  # whole-model compile: unchecked
    with pytest.raises(UnsupportedError, match="recompute='op'") as info:
        estimate(spec_from_hf_config(LLAMA), StepSpec(batch=2, seq=64, precision="bf16"), impl)
    assert "\n" not in str(info.value)


@pytest.mark.slow
@pytest.mark.parametrize("config,precision,impl,batch,seq", [
    (QWEN2, "fp32", BLOCK, 1, 96), (LLAMA, "bf16", BLOCK, 3, 40), (QWEN2, "bf16", FULL, 3, 40),
    (QWEN2, "bf16", ImplSpec(device="cpu", compile=True, compile_scope="block-loss"), 2, 48),
    (QWEN2, "amp-bf16", ImplSpec(device="cpu", compile=True, compile_scope="block-loss"), 3, 40),
    (LLAMA, "amp-bf16", FULL, 2, 48), (MISTRAL, "fp32", BLOCK, 2, 40),
    (QWEN3, "fp32", ImplSpec(device="cpu", compile=True), 2, 48), (QWEN3, "amp-bf16", BLOCK, 2, 40),
    (QWEN2, "bf16", ImplSpec(device="cpu", compile=True, compile_scope="block", recompute="op"), 2, 40)])
def test_per_block_estimate_equals_the_compiled_trace(config, precision, impl, batch, seq):
    pytest.importorskip("torch")
    from trainmem.trace import trace_step

    traced = trace_step(config, StepSpec(batch=batch, seq=seq, precision=precision), impl).meta["compile"]
    assert traced["scope"] == impl.compile_scope
    # under full recompute autograd also keeps a CPU generator state (5056 bytes of host memory) per
    # block for the recomputed SDPA (trace/compiled.py _save_rng_state); the estimate leaves it out
    states = config["num_hidden_layers"] if impl.recompute in ("full", "op") else 0
    # a whole-model graph saves the rotary inv_freq buffer itself (hd/2 fp32): the buffer ledger here
    buf = config.get("head_dim", config["hidden_size"] // config["num_attention_heads"]) // 2 * 4
    buf, n = (buf, 1) if impl.compile_scope == "model" else (0, 0)
    assert _saved(config, precision, impl, batch, seq) == (traced["saved_compiled_bytes"] - states * 5056 - buf,
                                                           traced["saved_compiled_tensors"] - states - n)


@pytest.mark.slow
def test_lora_per_block_estimate_equals_the_compiled_trace():
    pytest.importorskip("peft")
    from trainmem.specs.finetune import FinetuneSpec
    from trainmem.trace import trace_step

    step = StepSpec(batch=3, seq=40, precision="bf16")
    traced = trace_step(QWEN2, step, TORCHTUNE_FULL, finetune=FinetuneSpec(**LORA)).meta["compile"]
    states = QWEN2["num_hidden_layers"]  # one CPU generator state per block (host memory), as above
    assert _lora_saved(TORCHTUNE_FULL, "bf16", 3, 40, QWEN2) == (traced["saved_compiled_bytes"] - states * 5056,
                                                               traced["saved_compiled_tensors"] - states)
