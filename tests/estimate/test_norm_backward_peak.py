"""Moments inside the last block's backward (estimate/block_backward.py, phase ``backward``): with a
small hidden state against a wide head the step's top is a Llama-style RMSNorm's backward in 16-bit
(five fp32 norm-sized temporaries beside the residual gradient, the head's and the block's weight
gradients made so far) or, in fp32, the MLP product's backward (three (B, S, F) tensors); the plain ``ce`` estimate was 307,196 B under the trace on tiny Llama bf16
B=1 S=256 H=512 V=1000. Estimate == trace to the byte at the peak (the model's buffers, rotary
``inv_freq``, in both: estimate/buffers.py)."""

from __future__ import annotations

import pytest

from trainmem.estimate import estimate
from trainmem.estimate.block_backward import norm_backward_parts
from trainmem.inventory import Category
from trainmem.specs import ImplSpec, StepSpec
from trainmem.specs.loaders import spec_from_hf_config

IMPL = ImplSpec(attention="sdpa", device="cpu", optimizer_impl="fused")
CFG = dict(model_type="llama", hidden_size=512, intermediate_size=1024, num_hidden_layers=1,
           num_attention_heads=4, num_key_value_heads=2, vocab_size=1000)


def test_norm_moments_as_integers():
    e = estimate(spec_from_hf_config(CFG), StepSpec(batch=1, seq=256, precision="bf16"), IMPL)
    # the MLP's two, the attention's and the MLP's input projections', then the norms'
    mlp, down, qkv, gate, first, post = norm_backward_parts(e.inventory, 0, 256 * 512 * 2)
    # the MLP product's backward: down_proj's weight gradient (512·1024·2), its input gradient and the
    # product's two gradients (3·256·1024·2) beside the residual gradient; its saved input freed
    assert mlp == {"block_gradients": 1048576, "freed_activations": 524288, "after_attention": 0,
                   "work": 262144 + 3 * 524288}
    # the end of down_proj's backward: its weight gradient (new beside .grad from a second micro-batch) and
    # input gradient (256·1024·2); the product still saved (the block's output is the final norm's: nothing
    # after the product is freed)
    assert down == {"block_gradients": 1048576, "new_gradients": 1048576, "freed_activations": 0,
                    "after_attention": 0, "work": 262144 + 524288}
    # pre-MLP norm: the MLP's three weight gradients (3·1024·512·2) and the norm's (512·2); freed: its
    # rsqrt (256·4), normed_cast and out (2·256·512·2) and the MLP's four (B,S,F) bf16 tensors (4·256·1024·2)
    assert post == {"block_gradients": 3 * 1048576 + 1024, "freed_activations": 1024 + 2 * 262144 + 4 * 524288,
                    "after_attention": 0, "work": 262144 + 5 * 256 * 512 * 4}
    # input norm: every weight gradient of the block (attention q, o 512·512·2, k, v 256·512·2)
    assert first["after_attention"] == 1 and first["block_gradients"] == 3 * 1048576 + 3 * 524288 + 2 * 1024
    # the end of q_proj's backward: every weight gradient but the input norm's; the input norm's saved
    # tensors (rsqrt 256·4, normed_cast and out 2·256·512·2) still held; the residual gradient, v's and k's
    # input gradients summed, q's output gradient and q_proj's input gradient (4·256·512·2)
    assert qkv == {"block_gradients": first["block_gradients"] - 1024, "accum_new_gradients": 512 * 512 * 2,
                   "freed_activations": first["freed_activations"] - 1024 - 2 * 262144, "after_attention": 1,
                   "work": 4 * 262144}
    # the end of gate_proj's backward (block_backward.py _input_projections): the MLP's three weight gradients;
    # its four (B,S,F) tensors freed; the residual gradient, the norm output's gradient from up_proj, gate's
    # input gradient (3·256·512·2) and output gradient (256·1024·2)
    assert gate == {"block_gradients": 3 * 1048576, "accum_new_gradients": 1048576,
                    "freed_activations": 4 * 524288, "after_attention": 0, "work": 3 * 262144 + 524288}
    ph = {p.name: p for p in e.phases}
    assert e.peak_phase == "backward" and ph["backward"].parts["node_work"] == post["work"] + 8
    # the head's weight gradient and the final norm's exist; the untied embedding's does not yet
    assert ph["backward"].parts["gradients"] == 1000 * 512 * 2 + 1024 + post["block_gradients"]


def test_recompute_runs_the_moments_on_the_recomputed_block():
    """--recompute full: the checkpointed block recomputes its forward, then its nodes run (the same
    moments, beside the recomputed tensors); this config's estimate == trace (test_peak_gaps.py)."""
    impl = ImplSpec(attention="sdpa", device="cpu", recompute="full")
    e = estimate(spec_from_hf_config(CFG), StepSpec(batch=1, seq=256, precision="bf16"), impl)
    assert "RMSNorm" in next(p for p in e.phases if p.name == "backward").note


@pytest.mark.slow
@pytest.mark.parametrize("family,precision,S,layers,top,vocab", [(*c, 1000) if len(c) == 5 else c for c in [
    ("llama", "bf16", 256, 1, "0.post_attention_layernorm"),  # the reported config, 307,196 B under before
    ("qwen2", "bf16", 256, 1, "0.post_attention_layernorm"),
    ("llama", "fp16", 256, 3, "2.post_attention_layernorm"),
    ("llama", "bf16", 128, 1, "0.input_layernorm"),  # the only block's input norm: rotary cos/sin freed
    ("qwen2", "bf16", 200, 1, "0.input_layernorm"),
    ("llama", "bf16", 128, 2, "0.input_layernorm"),  # the first block of two (backward_first_block)
    ("llama", "fp32", 256, 1, "0.mlp"),  # fp32: the MLP product's backward, 571,400 B under before
    ("qwen2", "fp32", 256, 2, "0.mlp"),  # ... in the first block of two, 526,336 B under before
    # fp32, a small vocabulary, the weights outweighing the activations (S 64): the end of the first block's
    # q_proj backward (B 1: 522,496 B under before; Qwen2's q_proj bias gradient is made last)
    ("llama", "fp32", 64, 2, "0.self_attn.q_proj", 128),
    ("qwen2", "fp32", 64, 2, "0.self_attn.q_proj", 128),
    ("qwen3", "fp32", 64, 2, "0.self_attn.q_proj", 128),
]])
def test_estimate_equals_trace(family, precision, S, layers, top, vocab):
    pytest.importorskip("torch")
    from trainmem.trace import trace_step

    cfg = {**CFG, "model_type": family, "num_hidden_layers": layers, "vocab_size": vocab}
    step = StepSpec(batch=1, seq=S, precision=precision)
    t = trace_step(cfg, step, IMPL)
    e = estimate(spec_from_hf_config(cfg), step, IMPL)
    assert t.peak_module == f"model.layers.{top}"
    assert e.peak_phase == ("backward" if top.startswith(f"{layers - 1}.") else "backward_first_block")
    assert t.peak_logical_bytes == e.peak_bytes  # buffers included on both sides


@pytest.mark.slow
@pytest.mark.parametrize("family,precision", [("llama", "fp32"), ("qwen2", "bf16")])
def test_backward_end_equals_trace(family, precision):
    """At S=64 the top is the embedding's backward: every gradient, the residual gradient, the indices,
    the loss and its seed; the rotary cos/sin and (fp32) the embedding output block 0 kept are freed
    (were 196,600 B over in fp32, 32,760 B in bf16)."""
    pytest.importorskip("torch")
    from trainmem.trace import trace_step

    cfg = {**CFG, "model_type": family}
    step = StepSpec(batch=1, seq=64, precision=precision)
    t = trace_step(cfg, step, IMPL)
    e = estimate(spec_from_hf_config(cfg), step, IMPL)
    assert t.peak_module == "model.embed_tokens" and e.peak_phase == "backward_end"
    assert t.peak_logical_bytes == e.peak_bytes


@pytest.mark.slow  # one fake-tensor trace each, ~2 s
@pytest.mark.parametrize("precision,recompute", [("fp32", "none"), ("bf16", "none"), ("fp32", "full"),
                                                 ("bf16", "full"), ("amp-bf16", "none")])
def test_second_micro_batch_tops_at_the_down_projection(precision, recompute):
    """--grad-accum 2, H 512 > B·S 64: from the second micro-batch down_proj's new weight gradient (512·1024)
    sits beside its .grad with its input gradient and its still-saved input (the end of MmBackward0), the
    last block's top; SGD, vocabulary 128 (bf16 with full recompute was 524,288 B under at S 256, AdamW).
    Under autocast the bf16 weight gradient is cast to the fp32 weight's (ToCopyBackward0) after the node
    released its saved copy and input: amp-bf16 was 917,512 B under."""
    pytest.importorskip("torch")
    from trainmem.trace import trace_step

    cfg = {**CFG, "num_hidden_layers": 2, "vocab_size": 128}
    step = StepSpec(batch=1, seq=64, precision=precision, optimizer="sgd", grad_accum=2)
    impl = ImplSpec(attention="sdpa", device="cpu", recompute=recompute)
    t, e = trace_step(cfg, step, impl), estimate(spec_from_hf_config(cfg), step, impl)
    assert t.peak_module == "model.layers.1.mlp" and e.peak_phase == "backward"
    assert t.peak_logical_bytes == e.peak_bytes


def test_final_norm_moment_as_integers():
    """The final RMSNorm's backward (estimate/block_backward.py ``final_norm_moment``): its fp32 input and
    five fp32 x-sized temporaries beside the loss and its seed (no residual gradient yet). 1 layer,
    B 1, S 512, H 512: x is 512·512·4 = 1,048,576 B; a 16-bit model keeps its fp32 copy in the head."""
    from trainmem.estimate.block_backward import final_norm_moment

    cfg = {**CFG, "vocab_size": 128, "intermediate_size": 512}
    for precision, copy in (("bf16", 512 * 512 * 4), ("fp32", 0), ("amp-bf16", 0)):
        e = estimate(spec_from_hf_config(cfg), StepSpec(batch=1, seq=512, precision=precision, optimizer="sgd"), IMPL)
        assert final_norm_moment(e.inventory, head_act=0, loss_scalars=8) == (copy, 5 * 512 * 512 * 4 + 8)


@pytest.mark.slow  # one fake-tensor trace each, ~2-4 s
@pytest.mark.parametrize("precision,batch,seq", [("bf16", 1, 512), ("fp32", 1, 512), ("amp-bf16", 1, 512),
                                                 ("fp16", 2, 256)])
def test_final_norm_backward_tops_the_step(precision, batch, seq):
    """A wide head-side step (1 layer, V 128, S·B 512, SGD): the top is the final norm's backward ("model"
    ``mul``), which read 2,093,048-2,098,176 B under the trace before it was modelled (amp-bf16 2 layers S 256:
    524,288 B)."""
    pytest.importorskip("torch")
    from trainmem.trace import trace_step

    cfg = {**CFG, "vocab_size": 128, "intermediate_size": 512}
    step = StepSpec(batch=batch, seq=seq, precision=precision, optimizer="sgd")
    t, e = trace_step(cfg, step, IMPL), estimate(spec_from_hf_config(cfg), step, IMPL)
    assert (t.peak_module, t.peak_op) == ("model", "mul") and e.peak_phase == "backward"
    assert t.peak_logical_bytes == e.peak_bytes
