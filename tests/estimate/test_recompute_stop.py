"""Where a checkpointed block's recomputation stops (estimate/recompute_stop.py), and a frozen weight's autocast
copy in the block working set (estimate/peak.py ``_no_gradient_copies``), issue 13.

LoRA on the attention (peft's defaults: q/v, GPT-NeoX's query_key_value) under ``--recompute full``: the
recomputation stops at the down projection's saved weight copy (amp-bf16) or weight (fp32, bf16), with the MLP's
input, the down projection's input and, in GPT-NeoX's parallel block, the attention output alive as the forward's
locals. Before (CPU fake-tensor traces, AdamW, logical bytes): tiny Llama (h64, F176, 4/2 heads, V128) amp-bf16
B1 S64 2,048 B under, B1 S32 7,160 B over; tiny GPT-NeoX (h128, F512, V128) amp-bf16 B2 S64 65,800 B under,
B2 S96 98,568 B under, B1 S64 32,504 B over (the frozen MLP's 131,072 B weight copies taken for the working set's
largest gradient), B1 S32 81,656 B over; fp32 B1 / bf16 B2 S64 98,312 B under (the frozen MLP was not read: no
GELU output saved); tiny tied GPT-2 (h128, V128, n_positions 512) amp-bf16 B2 S64 65,800 B under, B1 S32 81,656 B
over, fp32 B1 / bf16 B2 S64 196,616 B under (its dropout mask is saved after c_proj: the recomputation makes c_proj's
output, and GPT2Block keeps the attention output in a local). Now equal."""

from __future__ import annotations

from dataclasses import fields

import pytest

from trainmem.estimate import estimate
from trainmem.specs import ImplSpec, StepSpec
from trainmem.specs.finetune import FinetuneSpec
from trainmem.specs.loaders import spec_from_hf_config

LLAMA = dict(model_type="llama", hidden_size=64, intermediate_size=176, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, vocab_size=128)
NEOX = dict(model_type="gpt_neox", hidden_size=128, intermediate_size=512, num_hidden_layers=2,
            num_attention_heads=4, vocab_size=128, max_position_embeddings=512)
GPT2 = dict(model_type="gpt2", n_embd=128, n_layer=2, n_head=4, vocab_size=128, n_positions=512)
LORA = FinetuneSpec(mode="lora", lora_rank=8)
#: every-k's blocks 0, K, 2K... (transformers' ``every_n_layers``), which the every-k tests below describe, where
#: ImplSpec names that choice (``recompute_from``; its default may be torchtitan's K-1, 2K-1...)
_FIRST = {"recompute_from": "first"} if "recompute_from" in {f.name for f in fields(ImplSpec)} else {}


def _step(precision, batch, seq):
    return StepSpec(batch=batch, seq=seq, precision=precision, optimizer="adamw")


def _estimate(cfg, precision, batch, seq=64):
    return estimate(spec_from_hf_config(cfg), _step(precision, batch, seq),
                    ImplSpec(attention="sdpa", device="cpu", recompute="full"), finetune=LORA)


def _backward(e):
    return next(p for p in e.phases if p.name == "backward")


def test_llama_stop_moment_as_integers():
    ph = _backward(_estimate(LLAMA, "amp-bf16", 1))
    R, x, prod = 64 * 64 * 4, 64 * 64 * 4, 64 * 176 * 2  # fp32 residual gradient, the MLP's fp32 input, bf16 product
    # the residual gradient and its bf16 cast for the MLP's output, the MLP's input and down_proj's input (frozen:
    # neither saved), the loss and its seed: 16,384 + 8,192 + 16,384 + 22,528 + 8 = 63,496
    assert ph.parts["node_work"] == R + R // 2 + x + prod + 8
    assert "gradients" not in ph.parts  # the MLP's backward has not run; the adapters' gradients come later


def test_neox_stop_moment_as_integers():
    ph = _backward(_estimate(NEOX, "amp-bf16", 2))
    R, gelu = 2 * 64 * 128 * 4, 2 * 64 * 512 * 2  # 65,536 and 131,072
    # the residual gradient and the bf16 sum's, the post-attention norm's fp32 output, the GELU output (frozen
    # dense_4h_to_h: not saved), dense_4h_to_h's bf16 bias copy (128 x 2), the attention branch's bf16 output
    assert ph.parts["node_work"] == R + R // 2 + R + gelu + 128 * 2 + R // 2 + 8


def test_gpt2_stop_past_the_down_projection_as_integers():
    ph = _backward(_estimate(GPT2, "amp-bf16", 1))
    R, x, act = 64 * 128 * 4, 64 * 128 * 4, 64 * 512 * 2  # fp32 residual gradient, ln_2's fp32 output, bf16 product
    # the dropout saves its mask after c_proj, so the recomputation makes c_proj's bf16 output (R // 2) beside its
    # input and bias copy (128 x 2); GPT2Block keeps the attention's bf16 output in a local (R // 2)
    assert ph.parts["node_work"] == R + R // 2 + x + act + 128 * 2 + R // 2 + R // 2 + 8


def test_frozen_weight_copy_is_not_the_largest_gradient():
    e = _estimate(NEOX, "amp-bf16", 1)
    # B1 S64: the frozen MLP's weight copies (512 x 128 x 2 = 131,072 B) are the block's largest saved tensors; with
    # no gradient of their size the working set (fp32 residual gradient + the 65,536 B GELU-input gradient) is
    # below the recomputation's stop, which is the phase
    assert _backward(e).parts.get("recompute_and_work") is None and e.peak_phase == "backward"


GRID = [(LLAMA, "amp-bf16", 1, 32), (LLAMA, "amp-bf16", 1, 64), (LLAMA, "amp-bf16", 2, 96),
        (NEOX, "amp-bf16", 1, 32), (NEOX, "amp-bf16", 1, 64), (NEOX, "amp-bf16", 2, 64), (NEOX, "amp-bf16", 2, 96),
        (NEOX, "fp32", 1, 64), (NEOX, "bf16", 2, 64),
        (GPT2, "amp-bf16", 1, 32), (GPT2, "amp-bf16", 2, 64), (GPT2, "fp32", 1, 64), (GPT2, "bf16", 2, 64)]


@pytest.mark.slow  # one fake-tensor trace each, ~2-5 s on 2 shared cores
@pytest.mark.parametrize("cfg,precision,batch,seq", GRID)
def test_lora_full_recompute_equals_trace(cfg, precision, batch, seq):
    pytest.importorskip("torch")
    from trainmem.trace import trace_step

    impl = ImplSpec(attention="sdpa", device="cpu", recompute="full")
    t = trace_step(cfg, _step(precision, batch, seq), impl, finetune=LORA)
    e = _estimate(cfg, precision, batch, seq)
    assert (e.peak_phase, e.peak_bytes) == ("backward", t.peak_logical_bytes)


#: LoRA on every linear (an adapted MLP): the recomputation stops at the down projection's ``lora_B`` weight copy
#: (estimate/recompute_stop.py ``adapter_down_moments``); before, tiny Llama amp-bf16 B2 S64 / S96 were 139,272 /
#: 208,904 B under, GPT-NeoX B2 S64 393,224 B under
ALL_LINEAR = {"llama": ("q_proj", "v_proj", "gate_proj", "up_proj", "down_proj"),
              "gpt_neox": ("query_key_value", "dense_h_to_4h", "dense_4h_to_h")}


@pytest.mark.slow  # one fake-tensor trace each, ~2-5 s
@pytest.mark.parametrize("cfg,seq", [(LLAMA, 64), (LLAMA, 96), (NEOX, 64)])
def test_adapted_mlp_stop_equals_trace(cfg, seq):
    pytest.importorskip("torch")
    from trainmem.trace import trace_step

    ft = FinetuneSpec(mode="lora", lora_rank=8, lora_targets=ALL_LINEAR[cfg["model_type"]])
    impl = ImplSpec(attention="sdpa", device="cpu", recompute="full")
    step = _step("amp-bf16", 2, seq)
    t = trace_step(cfg, step, impl, finetune=ft)
    e = estimate(spec_from_hf_config(cfg), step, impl, finetune=ft)
    assert t.peak_module.endswith("mlp.down_proj.lora_B.default") or t.peak_module.endswith("dense_4h_to_h.lora_B.default")
    assert (e.peak_phase, e.peak_bytes) == ("backward", t.peak_logical_bytes)


def test_first_block_recomputes_what_every_block_does():
    """Under checkpointing the frozen embedding's output requires a gradient (transformers'
    ``enable_input_require_grads``), so block 0's recomputation saves what block 1's does (its q/k/v weight copies,
    its lora_A copies, its input norm's rsqrt: 18,560 B more than an eager block 0, whose input needs no gradient).
    Tiny Llama amp-bf16 B1 S32, LoRA on q, v and the MLP: the first block's stop moment is the last block's plus
    block 1's adapter gradients, less block 1's kept input (the fp32 residual, 8,192 B)."""
    ft = FinetuneSpec(mode="lora", lora_rank=8, lora_targets=ALL_LINEAR["llama"])
    e = estimate(spec_from_hf_config(LLAMA), _step("amp-bf16", 1, 32),
                 ImplSpec(attention="sdpa", device="cpu", recompute="full"), finetune=ft)
    ph = {p.name: p for p in e.phases}
    later = sum(i.bytes for i in e.inventory.items if i.category.value == "gradient" and ".layers.1." in i.name)
    assert later == 30_208
    assert ph["backward_first_block"].bytes == ph["backward"].bytes + later - 32 * 64 * 4 == 914_760


@pytest.mark.slow  # one fake-tensor trace each, ~2-5 s
@pytest.mark.parametrize("cfg", [LLAMA, NEOX])
def test_first_block_stop_equals_trace(cfg):
    """The step's top in block 0's recomputation (amp-bf16 B1 S32, LoRA on every adapted MLP): before, tiny Llama
    read 18,560 B and GPT-NeoX 40,960 B under the trace (block 0's recomputed set taken from an eager block 0)."""
    pytest.importorskip("torch")
    from trainmem.trace import trace_step

    ft = FinetuneSpec(mode="lora", lora_rank=8, lora_targets=ALL_LINEAR[cfg["model_type"]])
    impl = ImplSpec(attention="sdpa", device="cpu", recompute="full")
    step = _step("amp-bf16", 1, 32)
    t = trace_step(cfg, step, impl, finetune=ft)
    e = estimate(spec_from_hf_config(cfg), step, impl, finetune=ft)
    assert ".layers.0." in t.peak_module
    assert (e.peak_phase, e.peak_bytes) == ("backward_first_block", t.peak_logical_bytes)


@pytest.mark.parametrize("recompute,phase,peak", [("full", "backward_first_block", 864_840),
                                                   ("none", "backward", 979_400)])
def test_adapted_down_input_gradient_sum_as_integers(recompute, phase, peak):
    """One dtype (fp32), LoRA on q, v and the MLP: lora_A saves the product itself, so the stop no longer counts it
    (nor the MLP's input, saved by gate/up's lora_A) again (it read 30,720 B over at B1 S32), and the top is the
    down projection's input-gradient sum: lora_A's and the frozen base layer's input gradients and their sum; in an
    eager step too (the last block's, its down projection's adapter gradients made)."""
    ft = FinetuneSpec(mode="lora", lora_rank=8, lora_targets=ALL_LINEAR["llama"])
    e = estimate(spec_from_hf_config(LLAMA), _step("fp32", 1, 32),
                 ImplSpec(attention="sdpa", device="cpu", recompute=recompute), finetune=ft)
    ph = {p.name: p for p in e.phases}[phase]
    R, prod = 32 * 64 * 4, 32 * 176 * 4  # the residual gradient, the product (B, S, F) fp32
    assert ph.parts["node_work"] == R + 3 * prod + 8  # 8: the loss and its seed
    assert (e.peak_phase, e.peak_bytes) == (phase, peak)


def test_adapted_up_projection_forward_as_integers():
    """bf16 base, fp32 adapters (peft's upcast), no autocast: the recomputation's top is the up projection's adapter
    forward, lora_B's fp32 (B, S, F) output and its scaled copy beside the base layer's bf16 output, the MLP's bf16
    input, the layer's ``residual`` local and what the down projection's adapter backward holds (the block output's
    gradient, the base branch's bf16 gradient, the adapter branch's fp32 one)."""
    ft = FinetuneSpec(mode="lora", lora_rank=8, lora_targets=ALL_LINEAR["llama"])
    e = estimate(spec_from_hf_config(LLAMA), _step("bf16", 2, 64),
                 ImplSpec(attention="sdpa", device="cpu", recompute="full"), finetune=ft)
    ph = {p.name: p for p in e.phases}["backward_first_block"]
    R, F = 2 * 64 * 64 * 2, 2 * 64 * 176  # the bf16 residual gradient, the (B, S, F) elements
    assert ph.parts["node_work"] == R + (R + 2 * R) + R + R + 2 * F + 2 * 4 * F + 8  # 8: the loss and its seed
    assert e.peak_bytes == 1_130_184


#: where an adapted MLP's step tops, by precision: fp32, the down projection's input-gradient sum (``add`` in its
#: base layer); bf16 with fp32 adapters, the up projection's adapter forward inside the recomputation (``mul``)
_ADAPTED_TOPS = {"fp32": ("add", (".down_proj.base_layer", ".dense_4h_to_h.base_layer")),
                 "bf16": ("mul", (".mlp.up_proj", ".mlp.dense_h_to_4h"))}


@pytest.mark.slow  # one fake-tensor trace each, ~2-5 s
@pytest.mark.parametrize("cfg,precision,batch,seq,recompute", [
    (LLAMA, "fp32", 1, 32, "full"), (LLAMA, "fp32", 2, 64, "full"), (LLAMA, "fp32", 1, 64, "full"),
    (NEOX, "fp32", 1, 32, "full"), (LLAMA, "bf16", 1, 32, "full"), (LLAMA, "bf16", 2, 64, "full"),
    (NEOX, "bf16", 1, 32, "full"), (NEOX, "bf16", 2, 64, "full"),
    (LLAMA, "fp32", 1, 32, "none"), (NEOX, "fp32", 1, 32, "none"), (NEOX, "fp32", 2, 64, "none")])
def test_adapted_mlp_top_equals_trace(cfg, precision, batch, seq, recompute):
    """LoRA on q, v and the MLP. Before (estimate - trace), full recompute: fp32 Llama B1 S32 -4,608 B, B2 S64
    +4,608, B1 S64 -1,536, GPT-NeoX B1 S32 -19,456 (the stop read the product and the MLP's input twice; the
    input-gradient sum was not read); bf16 Llama B1 S32 -15,368, B2 S64 -61,448 (the up projection's adapter forward
    was not read), GPT-NeoX B2 S64 +102,400 (the stop counted lora_A's saved fp32 copy of the product again and
    missed the promoted sum's two branch gradients). Eager fp32 (the input-gradient sum not read): Llama B1 S32
    -2,432, GPT-NeoX B1 S32 -68,616, B2 S64 -213,000."""
    pytest.importorskip("torch")
    from trainmem.trace import trace_step

    ft = FinetuneSpec(mode="lora", lora_rank=8, lora_targets=ALL_LINEAR[cfg["model_type"]])
    impl = ImplSpec(attention="sdpa", device="cpu", recompute=recompute)
    step = _step(precision, batch, seq)
    t = trace_step(cfg, step, impl, finetune=ft)
    e = estimate(spec_from_hf_config(cfg), step, impl, finetune=ft)
    op, modules = _ADAPTED_TOPS[precision]
    assert t.peak_op == op and t.peak_module.endswith(modules)
    assert e.peak_bytes == t.peak_logical_bytes


#: every-k at k=1 checkpoints every block, as --recompute full does: its blocks' node moments now run on the
#: recomputed set too (compiled_op_moment.recomputes_blocks), in their own peak parts (peak.py
#: _held_and_recomputed). Before, LoRA on every linear read under the trace: tiny Llama amp-bf16 B1 S32 34,824 B,
#: bf16 B2 S64 61,448 B, GPT-NeoX fp32 B1 S32 68,616 B, amp-bf16 B2 S64 393,224 B. At k=2 (block 1 eager) see
#: test_every_k_two_forward_equals_trace and test_every_k_two_eager_block_has_no_cache.
@pytest.mark.slow  # one fake-tensor trace each, ~2-5 s
@pytest.mark.parametrize("cfg,precision,batch,seq", [(LLAMA, "amp-bf16", 1, 32), (LLAMA, "bf16", 2, 64),
                                                     (NEOX, "fp32", 1, 32), (NEOX, "amp-bf16", 2, 64)])
def test_every_k_one_equals_trace(cfg, precision, batch, seq):
    pytest.importorskip("torch")
    from trainmem.trace import trace_step

    ft = FinetuneSpec(mode="lora", lora_rank=8, lora_targets=ALL_LINEAR[cfg["model_type"]])
    impl = ImplSpec(attention="sdpa", device="cpu", recompute="every-k", recompute_every=1)
    step = _step(precision, batch, seq)
    t = trace_step(cfg, step, impl, finetune=ft)
    e = estimate(spec_from_hf_config(cfg), step, impl, finetune=ft)
    assert e.peak_bytes == t.peak_logical_bytes


@pytest.mark.slow  # one fake-tensor trace each, ~1-4 s
@pytest.mark.parametrize("batch,seq", [(1, 32), (2, 64)])
def test_every_k_two_forward_equals_trace(batch, seq):
    """every-k, k=2, amp-bf16: block 1 runs eager and saves its casts, so the step tops in the loss's forward, where
    autocast's cache still holds block 0's (checkpointed) lora_A / lora_B bf16 weight copies, which a checkpointed
    block saves none of (estimate/forward_held.py reads them off its probe, which sees which weights require grad; a
    frozen base weight is not cached). Tiny Llama LoRA on q, v and the MLP read 4,744 B (B1 S32, its top then block 0's
    backward) and 15,104 B (B2 S64) under the trace, whose top is the loss's forward: block 0's adapter copies,
    2 x 1,024 (q) + 1,024 + 512 (v) + 3 x 3,840 (the MLP's), 15,104 B."""
    pytest.importorskip("torch")
    from trainmem.trace import trace_step

    ft = FinetuneSpec(mode="lora", lora_rank=8, lora_targets=ALL_LINEAR["llama"])
    impl = ImplSpec(attention="sdpa", device="cpu", recompute="every-k", recompute_every=2, **_FIRST)
    step = _step("amp-bf16", batch, seq)
    t = trace_step(LLAMA, step, impl, finetune=ft)
    e = estimate(spec_from_hf_config(LLAMA), step, impl, finetune=ft)
    assert {p.name: p for p in e.phases}["forward"].parts["autocast_unsaved_casts"] == 2 * 1024 + 1536 + 3 * 3840
    assert (t.peak_op, e.peak_phase, e.peak_bytes) == ("nll_loss_forward", "forward", t.peak_logical_bytes)


@pytest.mark.slow  # one fake-tensor trace each, ~1-4 s
@pytest.mark.parametrize("precision", ["amp-bf16", "bf16"])
def test_every_k_two_eager_block_has_no_cache(precision):
    """HF gradient checkpointing turns the KV cache off for the whole model (``use_cache = False`` in
    ``GPTNeoXModel.forward``), so under every-k the eager block 1 reads SDPA's V from the query_key_value output (kept
    whole), not from a cache copy. Estimated with the cache, its saved set held the 32,768 B copy instead of the
    98,304 B output, so block 1 looked recomputed and took a checkpointed block's stop moment: tiny GPT-NeoX LoRA on
    query_key_value and the MLP B2 S64 read 40,960 B over the trace (amp-bf16 and bf16). Now equal."""
    pytest.importorskip("torch")
    from trainmem.trace import trace_step

    ft = FinetuneSpec(mode="lora", lora_rank=8, lora_targets=ALL_LINEAR["gpt_neox"])
    impl = ImplSpec(attention="sdpa", device="cpu", recompute="every-k", recompute_every=2, **_FIRST)
    step = _step(precision, 2, 64)
    t = trace_step(NEOX, step, impl, finetune=ft)
    e = estimate(spec_from_hf_config(NEOX), step, impl, finetune=ft)
    assert "recomputed" not in {p.name: p for p in e.phases}["backward"].parts  # block 1 runs eager
    assert (e.peak_phase, e.peak_bytes) == ("backward_first_block", t.peak_logical_bytes)


@pytest.mark.slow  # one fake-tensor trace each, ~1-3 s
@pytest.mark.parametrize("targets", ["mlp", "every"])
def test_promoted_adapter_a_input_gradient_equals_trace(targets):
    """bf16 base, fp32 adapters, eager: the end of the down projection's lora_A node (recompute_stop.py
    ``_adapter_a_input_gradient``), its fp32 input gradient beside the base branch's bf16 gradient, lora_A's output
    gradient and the adapters' weight gradients. Tiny GPT-NeoX B1 S32 (LoRA on query_key_value and the MLP; on every
    linear) read 3,848 B under the trace, whose top is there (``mm`` in dense_4h_to_h.lora_A); now equal."""
    pytest.importorskip("torch")
    from trainmem.trace import trace_step

    every = ("query_key_value", "dense", "dense_h_to_4h", "dense_4h_to_h")
    ft = FinetuneSpec(mode="lora", lora_rank=8, lora_targets=ALL_LINEAR["gpt_neox"] if targets == "mlp" else every)
    impl = ImplSpec(attention="sdpa", device="cpu")
    step = _step("bf16", 1, 32)
    t = trace_step(NEOX, step, impl, finetune=ft)
    e = estimate(spec_from_hf_config(NEOX), step, impl, finetune=ft)
    assert t.peak_op == "mm" and t.peak_module.endswith("dense_4h_to_h.lora_A.default")
    assert (e.peak_phase, e.peak_bytes) == ("backward", t.peak_logical_bytes)
