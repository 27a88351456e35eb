"""Whole-model compile (``--compile --compile-scope model``): the token embedding's backward is AOTAutograd's
decomposed ``embedding_dense_backward``, two (V, H) tables in the computation dtype beside every other gradient
(estimate/compiled_embedding_backward.py). With a large vocabulary that is the step's peak."""

import pytest

from trainmem.estimate import estimate
from trainmem.specs import ImplSpec, StepSpec
from trainmem.specs.loaders import spec_from_hf_config

LLAMA = dict(model_type="llama", hidden_size=128, intermediate_size=352, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=8000, max_position_embeddings=256, tie_word_embeddings=False)
GPT2 = dict(model_type="gpt2", n_embd=128, n_layer=2, n_head=4, vocab_size=16000, n_positions=256,
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
QWEN2 = dict(LLAMA, model_type="qwen2", vocab_size=16000)


def _impl(scope="model", recompute="none"):
    return ImplSpec(device="cpu", attention="sdpa", compile=True, compile_scope=scope, recompute=recompute)


def test_the_moment_by_formula():
    """bf16 B1 S64, untied V 8000 H 128: every gradient but the embedding's, two fp32 tables, the fp32 output
    gradient and the ids' mask, at the end of backward."""
    step = StepSpec(batch=1, seq=64, precision="bf16", optimizer="adamw")
    e = estimate(spec_from_hf_config(LLAMA), step, _impl())
    end = {p.name: p for p in e.phases}["backward_end"]
    V, H = 8000, 128
    assert end.parts["embedding_grad_tables"] == 2 * V * H * 4
    assert end.parts["work"] == 64 * H * 4 and end.parts["embedding_ids_mask"] == 64
    grads = sum(i.bytes for i in e.inventory.items if i.category.value == "gradient")
    assert end.parts["gradients"] == grads - V * H * 2
    assert (e.peak.name, e.peak_bytes) == ("backward_end", end.bytes)


def test_per_block_compile_leaves_the_embedding_eager():
    step = StepSpec(batch=1, seq=64, precision="bf16", optimizer="adamw")
    end = {p.name: p for p in estimate(spec_from_hf_config(LLAMA), step, _impl("block")).phases}["backward_end"]
    assert "embedding_grad_tables" not in end.parts


@pytest.mark.slow  # one compiled trace each, ~6-10 s on 2 shared cores
@pytest.mark.parametrize("config,precision,accum,batch,seq", [
    (LLAMA, "bf16", 1, 1, 64), (LLAMA, "fp16", 1, 2, 32), (LLAMA, "bf16", 2, 1, 64),
    (dict(LLAMA, tie_word_embeddings=True), "fp32", 1, 2, 32),
    (dict(LLAMA, tie_word_embeddings=True), "bf16", 1, 1, 64),
    (GPT2, "bf16", 1, 1, 64), (GPT2, "fp32", 1, 2, 32), (QWEN2, "bf16", 1, 1, 64)])
def test_estimate_equals_the_compiled_trace(config, precision, accum, batch, seq):
    from trainmem.trace import trace_step

    step = StepSpec(batch=batch, seq=seq, precision=precision, optimizer="adamw", grad_accum=accum)
    e = estimate(spec_from_hf_config(config), step, _impl())
    t = trace_step(config, step, _impl())
    assert t.peak_op == "_unsafe_masked_index_put_accumulate" and e.peak.name == "backward_end"
    assert e.peak_bytes == t.peak_logical_bytes


def test_accumulation_counts_every_grad_and_the_graphs_new_ones():
    """grad-accum 2, fp32 untied: every stored .grad (the embedding's included) and the graph's other new
    gradients; no new gradient added by estimate/grad_accum.py. Under --recompute full the untied head runs in a
    graph of its own (transformers' checkpointing warning breaks it), so its new gradient was added in before."""
    step = StepSpec(batch=1, seq=64, precision="fp32", optimizer="adamw", grad_accum=2)
    V, H = 8000, 128
    for recompute, head_apart in (("none", 0), ("full", V * H * 4)):
        e = estimate(spec_from_hf_config(LLAMA), step, _impl(recompute=recompute))
        end = {p.name: p for p in e.phases}["backward_end"]
        grads = sum(i.bytes for i in e.inventory.items if i.category.value == "gradient")
        assert "new_gradient" not in end.parts and end.parts["accum_loss"] == 4
        assert end.parts["gradients"] == 2 * grads - V * H * 4 - head_apart


@pytest.mark.slow  # two compiled traces, ~12 s each on 2 shared cores
@pytest.mark.parametrize("config", [LLAMA, dict(LLAMA, tie_word_embeddings=True)])
def test_accumulation_under_full_recompute(config):
    """Was one fp32 (V, H) table over the trace untied (4,096,000 B: the head's new gradient, added in by its own
    graph) and 1,509,952 B under it tied (the embedding's stored .grad taken off)."""
    from trainmem.trace import trace_step

    step = StepSpec(batch=1, seq=64, precision="fp32", optimizer="adamw", grad_accum=2)
    e = estimate(spec_from_hf_config(config), step, _impl(recompute="full"))
    t = trace_step(config, step, _impl(recompute="full"))
    assert t.peak_op == "_unsafe_masked_index_put_accumulate" and e.peak.name == "backward_end"
    assert e.peak_bytes == t.peak_logical_bytes
