"""FSDP2's step peak in a middle block (estimate/fsdp_timeline.py ``middle_blocks``).

A middle block's backward holds what neither end block's does: its own gathered parameters, block
``i - 1``'s flat all-gather output that its ``pre_backward`` prefetched, and block ``i + 1``'s
reduce-scatter input (freed by block ``i``'s ``post_backward``). Under ``--recompute full`` the blocks
keep only their inputs, so that moment is the step's peak from 3 blocks on.

Fast: the units' arithmetic by hand, and the estimate's parts at that moment for the tiny Llama.
Slow: estimate == the real ``fully_shard`` step on fake tensors (trace/parallel_fsdp.py), to the byte:
Llama with 3 and 4 blocks, Qwen2 with 3, fp32 and fsdp-bf16, N = 2 and 4, resharded or kept, recompute
none and full; GPT-2 with 3 blocks under ``--recompute full`` (its recomputed attention reads the c_attn
views, no KV-cache copies: estimate/rules_hf.py ``_gpt_layer``), on one device too.
"""

from __future__ import annotations

import pytest

from trainmem.estimate import estimate
from trainmem.estimate.fsdp_timeline import Units, middle_blocks
from trainmem.specs import ImplSpec, ParallelSpec, StepSpec
from trainmem.specs.loaders import spec_from_hf_config

LLAMA = dict(model_type="llama", hidden_size=64, intermediate_size=176, num_hidden_layers=3, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=256, max_position_embeddings=256, tie_word_embeddings=False)
GPT2 = dict(model_type="gpt2", n_embd=64, n_layer=3, n_head=4, vocab_size=256, n_positions=256,
            attn_pdrop=0.0, embd_pdrop=0.0, resid_pdrop=0.0)
BLOCK = 2 * 64 * 64 + 2 * 32 * 64 + 3 * 64 * 176 + 2 * 64  # 46,208 parameters in a Llama block
ROOT = 2 * 256 * 64 + 64  # embedding, untied head, final norm: 32,832


def _units(n: int) -> Units:
    # blocks of 100 gathered bytes, 40 unsharded gradient bytes, 100 reduce-scatter input, 10 sharded gradient
    return Units(root_gathered=7, gathered=dict.fromkeys(range(n), 100), unsharded_grads=dict.fromkeys(range(n), 40),
                 rs_input=dict.fromkeys(range(n), 100), rs_output=dict.fromkeys(range(n), 10))


def test_middle_blocks_by_hand():
    assert middle_blocks(_units(2), reshard=True) == {}  # two blocks: both are ends
    # 3 blocks: block 1 gathered beside block 0's prefetched flat output and block 2's reduce-scatter input;
    # block 2 holds its sharded gradients (10) instead of autograd's (40)
    assert middle_blocks(_units(3), reshard=True) == {
        1: (10 - 40, {"fsdp_allgather": 200, "fsdp_reduce_scatter": 100, "fsdp_root_unsharded": 7})}
    # kept gathered: blocks 0 .. i still gathered (post_backward resharded the later ones), no prefetch
    assert middle_blocks(_units(3), reshard=False)[1][1]["fsdp_unsharded_params"] == 200
    # 5 blocks: the two ends of the middle range (live bytes are linear in between)
    five = middle_blocks(_units(5), reshard=False)
    assert sorted(five) == [1, 3] and five[1][0] == 3 * (10 - 40) and five[3][0] == 10 - 40
    assert (five[1][1]["fsdp_unsharded_params"], five[3][1]["fsdp_unsharded_params"]) == (200, 400)


def _rank(cfg, precision="fp32", rc="full", **par):
    step = StepSpec(batch=2, seq=64, precision=precision, optimizer="adamw")
    impl = ImplSpec(device="cpu", attention="sdpa", recompute=rc)
    (rank,) = estimate(spec_from_hf_config(cfg), step, impl, parallel=ParallelSpec(fsdp="full", **par)).ranks
    return rank


def test_middle_block_is_the_recomputed_peak():
    rank = _rank(LLAMA, dp=4)
    peak = rank.peak
    assert peak.name == "backward" and peak.note.startswith("backward of block 1")
    block = BLOCK * 4  # fp32, gathered: 184,832
    fsdp = {k: v for k, v in peak.parts.items() if k.startswith("fsdp_")}
    assert fsdp == {"fsdp_allgather": 2 * block, "fsdp_reduce_scatter": block, "fsdp_root_unsharded": ROOT * 4}
    # the root's unsharded gradients (head 256 x 64 and final norm 64, x 4), block 2's sharded ones (BLOCK / 4 x 4)
    # and, at block 1's MLP product's backward, down_proj's unsharded gradient (64 x 176 x 4)
    assert peak.parts["gradients"] == (256 * 64 + 64) * 4 + BLOCK + 64 * 176 * 4
    # measured: the trace's step peak (model.layers.1.mlp mul), to the byte (the slow test below)
    assert peak.bytes == 2_271_240


CASES = [("llama3", LLAMA, "fp32", 4, True, "full"), ("llama3", LLAMA, "fsdp-bf16", 2, False, "full"),
         ("llama4", dict(LLAMA, num_hidden_layers=4), "fp32", 2, False, "full"),
         ("llama4", dict(LLAMA, num_hidden_layers=4), "fsdp-bf16", 4, True, "full"),
         ("llama4", dict(LLAMA, num_hidden_layers=4), "fp32", 4, True, "none"),
         ("qwen2", dict(LLAMA, model_type="qwen2"), "fp32", 2, True, "full"),
         ("qwen2", dict(LLAMA, model_type="qwen2"), "fsdp-bf16", 4, False, "none")]


@pytest.mark.slow  # 3-6 s a case on 2 shared cores (FSDP2's lazy init, a step on fake tensors)
@pytest.mark.parametrize("name,cfg,precision,n,reshard,rc", CASES,
                         ids=[f"{c[0]}-{c[2]}-fsdp{c[3]}-{'reshard' if c[4] else 'keep'}-{c[5]}" for c in CASES])
def test_estimate_equals_the_fsdp2_trace(name, cfg, precision, n, reshard, rc):
    pytest.importorskip("transformers")
    from trainmem.trace import trace_step

    step = StepSpec(batch=2, seq=64, precision=precision, optimizer="adamw")
    impl = ImplSpec(device="cpu", attention="sdpa", recompute=rc)
    par = ParallelSpec(dp=n, fsdp="full", reshard_after_forward=reshard)
    traced = trace_step(cfg, step, impl, parallel=par)
    assert _rank(cfg, precision, rc, dp=n, reshard_after_forward=reshard).peak_bytes == traced.peak_logical_bytes


@pytest.mark.slow
@pytest.mark.parametrize("precision,single", [("fp32", "fp32"), ("fsdp-bf16", "bf16")])
def test_gpt2_recomputed_block_is_exact(precision, single):
    """GPT-2 ``--recompute full``: estimate == trace under FSDP2 and on one device (before the recomputed
    attention dropped its KV-cache copies, both were over by the same 65,536 B fp32 / 32,768 B bf16)."""
    pytest.importorskip("transformers")
    from trainmem.trace import trace_step

    impl = ImplSpec(device="cpu", attention="sdpa", recompute="full")
    step, one = (StepSpec(batch=2, seq=64, precision=p, optimizer="adamw") for p in (precision, single))
    par = ParallelSpec(dp=2, fsdp="full")
    fsdp = _rank(GPT2, precision, dp=2).peak_bytes - trace_step(GPT2, step, impl, parallel=par).peak_logical_bytes
    alone = estimate(spec_from_hf_config(GPT2), one, impl).peak_bytes - trace_step(GPT2, one, impl).peak_logical_bytes
    assert fsdp == alone == 0
