"""Qwen3-MoE and Mixtral under torch.compile (``estimate/rules_compiled_moe.py``): the router's and the
``grouped_mm`` experts' saved set inside a compiled block, against the compiled trace (per-block scopes)
and against the same compiled model on real tensors with the router's own expert ids (whole-model scope,
where the trace equals both: its forced ids are computed from each block's own router ids,
``trace/routing.py`` ``_derived_index``)."""

from __future__ import annotations

import pytest

from trainmem.errors import UnsupportedError
from trainmem.estimate import estimate
from trainmem.estimate.activations import activation_items
from trainmem.specs import ImplSpec, StepSpec
from trainmem.specs.loaders import spec_from_hf_config

QWEN = dict(model_type="qwen3_moe", hidden_size=64, intermediate_size=176, moe_intermediate_size=32,
            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=1000,
            max_position_embeddings=256, num_experts=4, num_experts_per_tok=2, norm_topk_prob=True)
QWEN_K8 = dict(QWEN, num_experts=16, num_experts_per_tok=8)  # E > 4, k > 4
QWEN_E128 = dict(QWEN_K8, num_experts=128)  # Qwen3-30B-A3B's router (128 experts, top 8)
MIXTRAL = dict(model_type="mixtral", hidden_size=64, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, vocab_size=1000, max_position_embeddings=256, num_local_experts=8,
               num_experts_per_tok=2)
BF16 = StepSpec(batch=2, seq=64, precision="bf16")


def _saved(config, impl, step=BF16):
    """Autograd's saved set: the items less the fp32 loss the caller holds (``loss.value``, 4 B)."""
    items = [i for i in activation_items(spec_from_hf_config(config), step, impl) if not i.name.endswith("loss.value")]
    return sum(i.bytes for i in items), len(items)


# B=2, S=64 (T=128 tokens), bf16. The attention half of a Qwen3-MoE block (the Llama compiled block with per-head
# q/k norms): input, two norm outputs, q_proj, o_proj, q_rope, SDPA out 7 x 16384, k_proj, k_rope, v 3 x 8192,
# rsqrt 2 x 512, q_norm/k_norm rsqrt 2048 + 1024, log-sum-exp 2048 (15 tensors) = 147456
QWEN_ATTN = 7 * 16384 + 3 * 8192 + 2 * 512 + 2048 + 1024 + 2048
# around the blocks (eager, per block scope): ids 1024, cos/sin 2 x 2048, final norm fp32 input, rsqrt, normed
# cast and output 32768 + 512 + 2 x 16384, fp32 log_softmax 128*1000*4, targets 1024, count 4 (10 tensors)
EAGER_HEAD = 1024 + 4096 + 32768 + 512 + 32768 + 512000 + 1024 + 4


def test_qwen3_moe_per_block_exact():
    # E=4, k=2, Fe=32, T·k=256: router logits T*E*2 = 1024 (E <= 4), top-k fp32 values 1024 and int64 ids 2048;
    # perm, perm // k, inv_perm 3 x 2048, offsets 16; gathered 256*64*2 = 32768, gate_up 256*64*2 = 32768,
    # act·up 256*32*2 = 16384, down 32768 (11 tensors) = 127504
    moe = 1024 + 1024 + 2048 + 3 * 2048 + 16 + 32768 + 32768 + 16384 + 32768
    impl = ImplSpec(device="cpu", compile=True, compile_scope="block")
    assert _saved(QWEN, impl) == (2 * (QWEN_ATTN + moe) + EAGER_HEAD, 2 * 26 + 10)  # 1124900, the trace's


def test_router_rules_follow_the_reduction_ban():
    impl = ImplSpec(device="cpu", compile=True, compile_scope="block")
    base, n = _saved(QWEN, impl)
    # E=16 > 4, k=8 > 4 (T·k = 1024): fp32 probabilities T*E*4 = 8192 for the logits 1024; top-k values T*k*4 =
    # 4096 for 1024, their sum T*4 = 512; ids T*k*8 = 8192 for 2048; perm, perm // k, inv_perm 3 x 8192 for
    # 3 x 2048; offsets 64 for 16; the grouped rows grow by 4x: 4 x 114688 for 114688
    grown = (8192 - 1024) + (4096 - 1024) + 512 + 4 * 6144 + 48 + 3 * 114688
    assert _saved(QWEN_K8, impl) == (base + 2 * grown, n + 2)  # 1883780, the trace's
    # E=128: the bf16 logits T*E*2 = 32768 and the softmax's fp32 row max and sum 2 x 512 for the probabilities
    # (8192 at E=16); offsets 512 for 64
    assert _saved(QWEN_E128, impl) == (base + 2 * (grown - 8192 + 32768 + 1024 + 448), n + 6)  # 1935876, the trace's
    # no renormalization (E=4, k=2): the sorted weights in bf16 (T·k*2 = 512) for the fp32 top-k values (1024)
    assert _saved(dict(QWEN, norm_topk_prob=False), impl) == (base - 2 * 512, n)  # 1123876, the trace's


def test_mixtral_whole_model_exact():
    # per block: the Llama compiled block (no q/k norms) input, norm outputs, o_proj, q_rope, SDPA out 6 x 16384,
    # k_rope, v 2 x 8192, rsqrt 2 x 512, log-sum-exp 2048 = 117760 (block 1 keeps its residual sum for o_proj's
    # output: the same bytes); the MoE MLP: E=8, fp32 probabilities 128*8*4 = 4096, top-k values 1024, ids 2048,
    # perm, perm // k, inv_perm 3 x 2048, offsets 32, gathered 32768, gate_up 256*96*2 = 49152, act·up 24576, down
    # 32768 = 152608; around them the final norm's input, rsqrt, output 16384 + 512 + 16384, the bf16 logits
    # 256000, row max and log-sum-exp 2 x 512, labels padded 2*65*8 = 1040, count 4, ids 1024
    head = 16384 + 512 + 16384 + 256000 + 1024 + 1040 + 4 + 1024
    assert _saved(MIXTRAL, ImplSpec(device="cpu", compile=True)) == (2 * (117760 + 152608) + head, 53)  # 833108


@pytest.mark.parametrize("config, precision, impl", [
    (QWEN, "fp32", ImplSpec(device="cpu", compile=True)),  # grouped_mm falls back to transformers' own op
    (QWEN, "bf16", ImplSpec(device="cpu", compile=True, compile_scope="block", recompute="op")),
    (dict(QWEN_K8, num_experts=24), "bf16", ImplSpec(device="cpu", compile=True)),  # between the E read (16, 32)
])
def test_unchecked_moe_settings_are_refused_by_name(config, precision, impl):
    with pytest.raises(UnsupportedError, match="model='qwen3_moe'") as info:
        estimate(spec_from_hf_config(config), StepSpec(batch=2, seq=64, precision=precision), impl)
    assert "\n" not in str(info.value)


@pytest.mark.slow
@pytest.mark.parametrize("config, scope, recompute", [
    (QWEN_K8, "block", "none"), (QWEN_E128, "block", "none"), (dict(QWEN, norm_topk_prob=False), "block-loss", "none"),
    (MIXTRAL, "block", "none"), (QWEN, "block", "full")])  # measured once more: Mixtral block-loss == trace
def test_estimate_equals_the_compiled_trace(config, scope, recompute):
    pytest.importorskip("torch")
    from trainmem.trace import trace_step

    impl = ImplSpec(device="cpu", compile=True, compile_scope=scope, recompute=recompute)
    traced = trace_step(config, BF16, impl).meta["compile"]
    # full recompute: one CPU generator state per block (5056 B of host memory), which the estimate leaves out
    rng = [5056] * config["num_hidden_layers"] * (recompute == "full")
    assert _saved(config, impl) == (traced["saved_compiled_bytes"] - sum(rng), traced["saved_compiled_tensors"] - len(rng))


@pytest.mark.slow
@pytest.mark.parametrize("config, recompute", [(QWEN_K8, "none"), (MIXTRAL, "none"), (QWEN, "none"), (QWEN, "full")])
def test_whole_model_estimate_equals_a_real_compiled_model_and_its_trace(config, recompute):
    pytest.importorskip("torch")
    from trainmem.trace import trace_step

    impl = ImplSpec(device="cpu", compile=True, recompute=recompute)
    real, rng, model = real_compiled_saved(config, impl)
    assert rng == config["num_hidden_layers"] * (recompute == "full")
    assert _saved(config, impl) == real
    # the trace: each block's forced ids are its own tensor (trace/routing.py _derived_index); with constant ids
    # the partitioner shared block 0's permutation and offsets (tiny Qwen3-MoE: 829,508 B for 833,076; with
    # full recompute 329,284 for 327,188, less the generator states). The trace also counts inv_freq, a buffer
    # autograd saves (head_dim / 2 fp32 values)
    traced = trace_step(config, BF16, impl).meta["compile"]
    inv_freq = model.model.rotary_emb.inv_freq.nbytes  # 32 B
    assert (traced["saved_compiled_bytes"] - 5056 * rng - inv_freq, traced["saved_compiled_tensors"] - rng - 1) == real


def real_compiled_saved(config, impl):
    """``((bytes, tensors), generator states, model)``: what a compiled bf16 step on real CPU tensors, the
    router choosing its own experts, saves for backward, less ``inv_freq`` (a buffer) and full recompute's
    CPU generator states (5,056 B of host memory each, counted apart)."""
    import torch
    from trainmem.models.hf import build_hf_model
    from trainmem.trace.compiled import compile_model
    from trainmem.trace.recompute import enable_recompute
    from trainmem.trace.saved import saved_tensors

    torch.manual_seed(0)
    model = build_hf_model(config, dtype=torch.bfloat16)
    model.train()
    enable_recompute(model, impl)
    runs, _ = compile_model(model, impl)
    ids = torch.randint(0, 1000, (2, 64))
    runs(ids, labels=ids).loss.backward()
    saved, out = saved_tensors(model, lambda: runs(ids, labels=ids).loss, buffers=False)
    del out
    rng = [t for t in saved if t.nbytes == 5056 and t.dtype == "uint8"]
    return (sum(t.nbytes for t in saved) - 5056 * len(rng), len(saved) - len(rng)), len(rng), model
