"""A compiled Llama block's backward moments without checkpointing (``--compile``, ``--recompute none``,
estimate/compiled_block_moment.py): the partitioned backward recomputes ``silu(gate)`` from the saved gate and
runs SiLU's decomposed backward in fp32. With a small vocabulary (V 32) the step peaks there; exact against the
trace (``trace/compiled.py``: inductor's partition run op by op, no fusion)."""

import pytest

from trainmem.estimate import estimate
from trainmem.specs import ImplSpec, StepSpec
from trainmem.specs.loaders import spec_from_hf_config

LLAMA = dict(model_type="llama", hidden_size=64, intermediate_size=176, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=32, max_position_embeddings=256, tie_word_embeddings=False)


def _peak(precision, scope, config=LLAMA):
    e = estimate(spec_from_hf_config(config), StepSpec(batch=2, seq=64, precision=precision, optimizer="adamw"),
                 ImplSpec(device="cpu", attention="sdpa", compile=True, compile_scope=scope))
    return e.peak_bytes, e.peak.name


def test_whole_model_bf16_peaks_at_silu_backward_of_the_last_block():
    # B 2, S 64, H 64, F 176, 4/2 heads, 4 blocks, V 32, bf16, AdamW. Resident: parameters 377984, AdamW 755968,
    # rotary buffers 64. Kept by the one graph: every saved tensor but the head's (1029120, the ids included)
    # less block 3's gate, up and product 3 x 45056 and its output 16384 (freed by the final norm's backward):
    # 877568. Work: the residual gradient 16384, up_proj's input gradient 16384, the gate's fp32 copy and
    # silu_backward's three fp32 temporaries 4 x 90112, each block's cached k and v's zero tangents 8 x 8192: 458752.
    # Gradients: lm_head 4096, the final norm 128, block 3's down_proj and up_proj 2 x 22528: 49280; loss scalars 8.
    # 1134016 + 877568 + 458752 + 49280 + 8 = 2519624 (the trace's peak, to the byte; 2232896 before: 0.886)
    assert _peak("bf16", "model") == (2519624, "backward")


def test_whole_model_fp32_peaks_at_the_recomputed_sigmoid():
    # fp32: resident 755968 + 1511936 + 64. Kept: 2044928 less block 3's product 90112 and output 32768: 1922048
    # (the gate is its own fp32 copy, held). Work, while sigmoid(gate) is recomputed after down_proj's backward:
    # the residual gradient 32768, the product's gradient 90112, two fp32 temporaries of 1 / (1 + exp(-gate))
    # 2 x 90112, the cache's zero tangents 8 x 16384: 434176. Gradients: the head's 8448, down_proj's 45056; scalars 8.
    # 2267968 + 1922048 + 434176 + 53504 + 8 = 4677704 (the trace's peak; 4452416 before: 0.952)
    assert _peak("fp32", "model") == (4677704, "backward")


def test_per_block_holds_the_blocks_own_cache_tangents():
    # per block each backward graph gets its own k and v tangents: 2 x 8192 where the one graph held 8 x 8192 (the
    # trace's peak 2474568 B; 2351688 before: 0.950)
    assert _peak("bf16", "block") == (2474568, "backward")


V256 = dict(LLAMA, num_hidden_layers=2, vocab_size=256)
V1000 = dict(V256, vocab_size=1000)


def test_whole_model_loss_backward_holds_the_graphs_zero_tangents():
    # V 256, 2 blocks, bf16: the loss ends the one graph, whose backward starts with zero-filled tangents for the
    # outputs the loss does not read: the logits B*S*V*2 = 65536 and each block's cached k and v 2 x 2 x 8192
    # (estimate/compiled_ce_loss.py graph_tangents), beside the compiled loss's three fp32 B*S*V 3 x 131072 and
    # the kept set less the logits and the labels' padded copy: 751552 + 541188 + 393216 + 4 + 98304 = 1784264
    # (the trace's peak; 1627208 before, 0.912). fp32: _nll_loss_backward's product holds the one-hot where, the
    # product, the fp32 logits as kept and the row weights B*S*4: 3167048 (the trace's; 2970968 before, 0.938)
    assert _peak("bf16", "model", V256) == (1784264, "backward_start")
    assert _peak("fp32", "model", V256) == (3167048, "backward_start")


def test_whole_model_with_full_recompute_keeps_the_logits_tangent_alone():
    # checkpointing turns the KV cache off: at the loss's backward only the logits' zero tangent, B*S*V*2 = 256000
    # (V 1000, bf16): 3183048 B, the trace's peak (measured: trace --compile --recompute full, 19 s)
    e = estimate(spec_from_hf_config(V1000), StepSpec(batch=2, seq=64, precision="bf16", optimizer="adamw"),
                 ImplSpec(device="cpu", attention="sdpa", compile=True, recompute="full"))
    assert (e.peak_bytes, e.peak.name, e.peak.parts["zero_tangents"]) == (3183048, "backward_start", 256000)


@pytest.mark.slow  # eight compiled traces, ~7-15 s each on 2 shared cores
@pytest.mark.parametrize("precision,scope,config,phase", [
    ("bf16", "model", LLAMA, "backward"), ("fp32", "model", LLAMA, "backward"), ("bf16", "block", LLAMA, "backward"),
    ("fp32", "block", LLAMA, "backward"), ("bf16", "block-loss", LLAMA, "backward"),
    ("bf16", "block", dict(LLAMA, num_key_value_heads=4), "backward"),  # k and v at 4 heads (2,654,792 B)
    ("bf16", "model", V256, "backward_start"), ("fp32", "model", V256, "backward_start")])
def test_estimate_peak_equals_the_compiled_trace(precision, scope, config, phase):
    from trainmem.trace import trace_step

    step = StepSpec(batch=2, seq=64, precision=precision, optimizer="adamw")
    impl = ImplSpec(device="cpu", attention="sdpa", compile=True, compile_scope=scope)
    assert _peak(precision, scope, config) == (trace_step(config, step, impl).peak_logical_bytes, phase)


@pytest.mark.slow  # one whole-model compiled trace with checkpointed blocks, ~20 s on 2 shared cores
def test_whole_model_full_recompute_loss_backward_equals_the_trace():
    from trainmem.trace import trace_step

    step = StepSpec(batch=2, seq=64, precision="bf16", optimizer="adamw")
    impl = ImplSpec(device="cpu", attention="sdpa", compile=True, recompute="full")
    assert estimate(spec_from_hf_config(V1000), step, impl).peak_bytes == trace_step(V1000, step, impl).peak_logical_bytes
