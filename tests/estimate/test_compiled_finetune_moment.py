"""A fine-tuned checkpointed compiled block's MLP moments (``--finetune lora --compile --compile-scope block-loss
--recompute full``, torchtune's LoRA recipes; estimate/compiled_finetune_moment.py): the block's backward graph
recomputes its forward and holds what its backward reads, the eager saved set, until that read. Exact against
the trace (``trace/compiled.py``, inductor's partition run op by op), the caller's token ids included: a frozen
embedding saves none, the caller holds them (estimate/phase_parts.py ``caller_ids``; left out before, 1,024 B)."""

import pytest

from trainmem.estimate import estimate
from trainmem.estimate.activations import activation_inventory, activation_items
from trainmem.estimate.compiled_finetune_moment import finetune_checkpoint_moments
from trainmem.estimate.compiled_recompute import compiled_checkpoint_moments
from trainmem.estimate.model_states import model_state_inventory, model_state_items
from trainmem.estimate.peak import recompute_per_layer
from trainmem.inventory import dtype_bytes
from trainmem.specs import ImplSpec, StepSpec
from trainmem.specs.finetune import FinetuneSpec
from trainmem.specs.loaders import spec_from_hf_config

LLAMA = dict(model_type="llama", hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=256, max_position_embeddings=256, tie_word_embeddings=False)
LORA = FinetuneSpec(mode="lora", lora_rank=8, lora_alpha=16, lora_targets=("q_proj", "v_proj"), adapter_dtype="param")
FULL_BLOCK = ImplSpec(device="cpu", attention="sdpa", compile=True, compile_scope="block", recompute="full")
TORCHTUNE = ImplSpec(device="cpu", attention="sdpa", compile=True, compile_scope="block-loss", recompute="full")


def _step(precision):
    return StepSpec(batch=2, seq=64, precision=precision, optimizer="adamw")


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16", "amp-bf16"])
def test_the_eager_set_reads_as_the_compiled_set_without_fine_tuning(precision):
    # one mechanism read two ways: on the compiled saved set (compiled_recompute.py) and on the eager one (here),
    # each block's two moments add the same bytes to what the phase holds outside the block
    m, step = spec_from_hf_config(LLAMA), _step(precision)
    kept = model_state_inventory(m, step, "hf") + activation_inventory(m, step, FULL_BLOCK)
    compiled = activation_inventory(m, step, ImplSpec(device="cpu", attention="sdpa", compile=True,
                                                      compile_scope="block"), kv_cache=False)
    eager = activation_inventory(m, step, ImplSpec(device="cpu", attention="sdpa"), kv_cache=False)
    residual = 2 * 64 * 64 * dtype_bytes(step.dtypes.compute)  # B·S·H
    for li in (0, 1):
        on_compiled = _added(kept, compiled, li, compiled_checkpoint_moments(kept, li, residual, compiled))
        on_eager = _added(kept, eager, li, finetune_checkpoint_moments(kept, li, residual, eager, act_held=1,
                                                                       act_work=3))
        assert len(on_eager) == 2 and on_eager == on_compiled


def _added(kept, plain, li, moments):
    """What each moment adds to the phase beyond what it holds outside the block (peak.phases' arithmetic)."""
    return [recompute_per_layer(kept, plain)[li][0] - w["freed_activations"] + w["work"] + w["block_gradients"]
            for w in moments]


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_gemmas_eager_set_reads_as_its_compiled_set(precision):
    # GELU-tanh (four fp32 B·S·F held, two written at once) and GemmaRMSNorm (its fp32 normalized product and
    # 1 + weight, in the eager set itself): the compiled set's reading (compiled_recompute.py, == trace) again
    from trainmem.estimate.compiled_recompute import _ACTIVATIONS
    gemma = dict(model_type="gemma", hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=1, head_dim=16, vocab_size=128, max_position_embeddings=256,
                 tie_word_embeddings=True)
    m, step = spec_from_hf_config(gemma), _step(precision)
    kept = model_state_inventory(m, step, "hf") + activation_inventory(m, step, FULL_BLOCK)
    compiled = activation_inventory(m, step, ImplSpec(device="cpu", attention="sdpa", compile=True,
                                                      compile_scope="block"), kv_cache=False)
    eager = activation_inventory(m, step, ImplSpec(device="cpu", attention="sdpa"), kv_cache=False)
    residual = 2 * 64 * 64 * dtype_bytes(step.dtypes.compute)
    held, work = _ACTIVATIONS["geglu"]
    for li in (0, 1):
        on_compiled = _added(kept, compiled, li, compiled_checkpoint_moments(
            kept, li, residual, compiled, activation="geglu", unit_offset_norm=True))
        on_eager = _added(kept, eager, li, finetune_checkpoint_moments(kept, li, residual, eager, act_held=held,
                                                                       act_work=work))
        assert len(on_eager) == 2 and on_eager == on_compiled


def test_lora_bf16_peaks_at_silu_backward_of_the_first_block():
    # LoRA q/v r 8 on the tiny Llama, bf16. Resident: parameters 257664, AdamW on the adapters 2 x 7168, the rotary
    # buffers 64: 272064. Kept: the frozen embedding's output 16384 (the leaf enable_input_require_grads makes,
    # held by its AccumulateGrad node), cos/sin 2 x 2048. Block 1's adapter gradients 3584. Recomputed and held
    # (block 0 reads as block 1: its input requires grad): the input norm's fp32 input 32768, rsqrt 512 and output
    # 16384 (the lora_A gradients read it), the two lora_A outputs 2 x 2048, q 16384, k and v 2 x 8192, SDPA output
    # 16384 and logsumexp 2048, the post-attention norm's fp32 input 32768 and rsqrt 512 (no normalized products:
    # frozen norm weights; no output: frozen gate/up), the gate's fp32 copy 90112: 228352. Work: the residual
    # gradient 16384, up_proj's input gradient 16384, silu_backward's fp32 3 x 90112; the loss scalars 8.
    # 272064 + 20480 + 3584 + 228352 + 303104 + 8 + 1024 (the caller's ids) = 828616, the trace's
    e = estimate(spec_from_hf_config(LLAMA), _step("bf16"), TORCHTUNE, finetune=LORA)
    assert (e.peak_bytes, e.peak.name) == (828616, "backward_first_block")


def test_lora_fp32_peaks_at_the_product_backward_of_the_last_block():
    # fp32: resident 515328 + 28672 + 64; kept: the embedding's leaf 32768, cos/sin 2 x 4096, block 1's input
    # (block 0's output, its input norm's fp32 input itself) 32768. Held: rsqrt 512, the input norm's output 32768,
    # lora_A outputs 2 x 4096, q 32768, k, v 2 x 16384, SDPA output 32768, logsumexp 2048, the residual sum 32768,
    # rsqrt 512, gate, silu(gate), up 3 x 90112: 445440. Work: the residual gradient 32768, down_proj's input
    # gradient and grad*up 2 x 90112 (frozen down_proj: no weight gradient); the loss scalars 8.
    # 544064 + 73728 + 445440 + 212992 + 8 + 1024 (the caller's ids) = 1277256, the trace's
    e = estimate(spec_from_hf_config(LLAMA), _step("fp32"), TORCHTUNE, finetune=LORA)
    assert (e.peak_bytes, e.peak.name) == (1277256, "backward")


def test_a_frozen_first_block_beside_a_trained_one_gets_no_moment():
    # block 0 recomputes what block 1 saves only when both train the same weights: otherwise the working set stands
    ft = FinetuneSpec(mode="full", freeze=("embeddings", "layers.0"))
    m, step = spec_from_hf_config(LLAMA), _step("bf16")
    spec = ft.for_model(m)
    kept = model_state_items(m, step, spec) + activation_items(m, step, FULL_BLOCK, spec)
    eager = activation_items(m, step, ImplSpec(device="cpu", attention="sdpa"), spec, kv_cache=False)
    assert finetune_checkpoint_moments(kept, 0, 16384, eager, act_held=1, act_work=3) == []
    assert len(finetune_checkpoint_moments(kept, 1, 16384, eager, act_held=1, act_work=3)) == 2


@pytest.mark.slow  # six compiled traces, ~5-10 s each on 2 shared cores
@pytest.mark.parametrize("precision,ft,phase", [
    ("bf16", LORA, "backward_first_block"), ("fp32", LORA, "backward"), ("fp16", LORA, "backward_first_block"),
    # autocast: one bf16 cast of the input norm's output for both adapters, the weight copies until their mm
    # (1,199,944 B at block 1's SiLU backward, 0.900 before)
    ("amp-bf16", LORA, "backward"),
    # adapters on every linear: the gate's lora_A output and the post-attention norm's output are held too
    # (963,528 B, 0.857 of the trace before)
    ("bf16", FinetuneSpec(mode="lora", lora_rank=8, lora_alpha=16, lora_targets=("all-linear",), adapter_dtype="param"),
     "backward_first_block"),
    # full fine-tuning of the blocks, a frozen embedding: block 0 reads as block 1 with its norms' normalized
    # products and the weight gradients (1,453,384 B)
    ("bf16", FinetuneSpec(mode="full", freeze=("embeddings",)), "backward_first_block")])
def test_estimate_equals_the_compiled_trace(precision, ft, phase):
    from trainmem.trace import trace_step

    e = estimate(spec_from_hf_config(LLAMA), _step(precision), TORCHTUNE, finetune=ft)
    t = trace_step(LLAMA, _step(precision), TORCHTUNE, finetune=ft)
    assert next(i for i in e.inventory.base if i.name == "model.embed_tokens.indices").bytes == 0  # not saved
    assert (e.peak_bytes, e.peak.name) == (t.peak_logical_bytes, phase)


QLORA_LLAMA = dict(LLAMA, hidden_size=256, intermediate_size=512, num_key_value_heads=4)  # to_nf4: 64·256 multiples
QLORA = FinetuneSpec(mode="qlora", quant_impl="torchao-nf4", lora_targets=("q_proj", "v_proj", "gate_proj"))


def test_qlora_holds_each_dequantized_weight_until_its_input_gradient():
    # H 256, F 512, 4 heads (4 K/V), bf16 base, fp32 adapters. At block 0's SiLU backward the recompute holds the
    # dequantized q, k, v, o (4 x 131072) and gate (262144) weights: their input-gradient mms are still to run
    # (up's and down's ran); the phase's one dequantized weight (finetune.py, the largest: 262144) is among them.
    # The adapters' fp32 casts of the input norm's output (q's and v's, 131072 each in the eager set) are one
    # tensor in the compiled graph (CSE). The trace's SiLU moment is 4,193,668 B (the caller's ids 1024 included)
    e = estimate(spec_from_hf_config(QLORA_LLAMA), _step("bf16"), TORCHTUNE, finetune=QLORA)
    first = {p.name: p for p in e.phases}["backward_first_block"]
    assert (e.peak_bytes, e.peak.name, first.parts["dequant_temporary"]) == (4193668, "backward_first_block",
                                                                             262144)


def _silu_moments(trace) -> list[int]:
    """The trace's logical bytes at each silu_backward's product (the op after its fp32 sigmoid), in order."""
    rec, logical, out, after = trace.recording, 0, [], False
    for e in rec.events:
        b = rec.blocks[e if e >= 0 else ~e]
        logical += b.nbytes if e >= 0 else -b.nbytes
        if e >= 0 and after:
            out.append(logical)
        after = e >= 0 and b.phase == "backward" and b.op == "sigmoid" and b.dtype == "float32"
    return out


@pytest.mark.slow  # one QLoRA compiled trace, ~11 s on 2 shared cores
def test_qlora_moments_equal_the_traces_and_its_peak_is_the_unfused_nf4_dequantization():
    pytest.importorskip("torchao")
    from trainmem.trace import trace_step

    e = estimate(spec_from_hf_config(QLORA_LLAMA), _step("bf16"), TORCHTUNE, finetune=QLORA)
    t = trace_step(QLORA_LLAMA, _step("bf16"), TORCHTUNE, finetune=QLORA)
    phases = {p.name: p.bytes for p in e.phases}
    # block 1's, then block 0's SiLU backward: 4,136,324 and 4,193,668 B, the caller's ids included
    assert [phases["backward"], phases["backward_first_block"]] == _silu_moments(t)
    # the trace's peak (4,849,028 B) is torchao's dequantization run unfused (its int64 codes, NF4's lookup):
    # the compiled rule counts the weight alone, as inductor fuses it (finetune.py dequant_transient)
    assert t.peak_op == "index" and t.peak_logical_bytes > e.peak_bytes
