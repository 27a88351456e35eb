"""Serving per rank (issue 15, item 6): vLLM's TP rule for weights and KV heads, PP stages, weight
formats, KV-cache dtype, chunked prefill and the KV pool's capacity. Exact integers throughout."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from trainmem.errors import SpecError
from trainmem.estimate.inference import inference_estimate, serving_stages
from trainmem.estimate.inference_weights import linear_bytes
from trainmem.estimate.symbols import evaluate, symbol_values
from trainmem.fits import NCCL_BYTES
from trainmem.inventory import Category
from trainmem.plan.hardware import load_gpu
from trainmem.specs import ImplSpec, ParallelSpec, StepSpec
from trainmem.specs.loaders import load_model

L3 = load_model("llama-3-8b")  # 32 layers, H 4096, 32/8 heads, hd 128, F 14336, V 128256, untied
BF16 = StepSpec(batch=1, seq=2048, precision="bf16")


def _params(e) -> int:
    return e.totals_bytes["parameter"]


def test_tp4_weights_per_rank_are_the_column_row_and_vocab_shards():
    e = inference_estimate(L3, BF16, parallel=ParallelSpec(tp=4), context=2048)
    # per layer: q 4096·1024, k and v 2 heads·128 = 256 rows × 4096, o 1024·4096, gate/up 3584·4096,
    # down 4096·3584, two norms 4096 (replicated); embedding and head ⌈128256/4⌉ = 32064 rows; final norm
    layer = 4096 * 1024 + 2 * 256 * 4096 + 1024 * 4096 + 3 * 3584 * 4096 + 2 * 4096
    assert _params(e) == (32 * layer + 2 * 32064 * 4096 + 4096) * 2
    assert [(r.name, r.count) for r in e.ranks] == [("rank", 4)]


def test_kv_heads_are_replicated_when_tp_exceeds_them():
    # vLLM QKVParallelLinear: tp=16 > 8 kv heads -> one head per rank (2 replicas each); tp=8 -> one too
    cache = {tp: inference_estimate(L3, BF16, parallel=ParallelSpec(tp=tp), context=4096).totals_bytes["kv_cache"]
             for tp in (1, 2, 8, 16)}
    assert cache[1] == 2 * 32 * 4096 * 8 * 128 * 2
    assert cache[2] == 2 * 32 * 4096 * 4 * 128 * 2
    assert cache[8] == cache[16] == 2 * 32 * 4096 * 1 * 128 * 2
    e16 = inference_estimate(L3, BF16, parallel=ParallelSpec(tp=16), context=4096)
    k = next(i for i in e16.inventory if i.name.endswith("layers.0.self_attn.k_proj.weight"))
    assert k.shape == (128, 4096)  # one replicated head, not 1024/16 = 64 rows
    for item in e16.inventory.select(Category.KV_CACHE):  # the formula states the replicated head
        assert evaluate(item.formula, symbol_values(L3, BF16, ParallelSpec(tp=16), context=4096)) == item.bytes


@pytest.mark.parametrize("tp,what", [(3, "num_heads"), (64, "must divide num_heads")])
def test_tp_that_does_not_divide_is_refused(tp, what):
    with pytest.raises(SpecError, match="tp"):
        inference_estimate(L3, BF16, parallel=ParallelSpec(tp=tp), context=2048)


def test_pp_stages_keep_their_layers_weights_and_cache():
    one = inference_estimate(L3, BF16, context=4096)
    e = inference_estimate(L3, BF16, parallel=ParallelSpec(pp=2), context=4096)
    s0, s1 = e.ranks
    assert (s0.layers, s1.layers) == ((0, 16), (16, 32))
    layer = (4096 * 4096 * 2 + 2 * 1024 * 4096 + 3 * 14336 * 4096 + 2 * 4096) * 2
    assert s0.totals_bytes["parameter"] == 16 * layer + 128256 * 4096 * 2           # + embedding
    assert s1.totals_bytes["parameter"] == 16 * layer + 128256 * 4096 * 2 + 4096 * 2  # + head, final norm
    assert s0.totals_bytes["parameter"] + s1.totals_bytes["parameter"] == _params(one)
    assert s0.totals_bytes["kv_cache"] == s1.totals_bytes["kv_cache"] == 2 * 16 * 4096 * 8 * 128 * 2
    assert "prefill_logits" in {p.name for p in s1.phases} and "prefill_logits" not in {p.name for p in s0.phases}


def test_uneven_stages_follow_vllm_get_pp_indices():
    # 30 layers on 4 stages: 7 each, the remainder 2 to the second-last and third-last stages
    assert serving_stages(30, ParallelSpec(pp=4)) == [(0, 7), (7, 15), (15, 23), (23, 30)]
    # 32 on 3: [10, 10, 10] + 1 to stages -2 and -3
    assert serving_stages(32, ParallelSpec(pp=3)) == [(0, 11), (11, 22), (22, 32)]
    assert serving_stages(30, ParallelSpec(pp=2, layer_split=(10, 20))) == [(0, 10), (10, 30)]
    with pytest.raises(SpecError, match="layer_split"):
        serving_stages(30, ParallelSpec(pp=2, layer_split=(10, 10)))
    e = inference_estimate(replace(L3, num_layers=30), BF16, parallel=ParallelSpec(pp=4), context=2048)
    assert [r.layers for r in e.ranks] == [(0, 7), (7, 15), (15, 23), (23, 30)]
    assert [r.totals_bytes["kv_cache"] for r in e.ranks] == [2 * n * 2048 * 8 * 128 * 2 for n in (7, 8, 8, 7)]


def test_tied_embeddings_under_pp_the_last_stage_keeps_a_head():
    gpt2 = load_model("gpt2")  # tied wte: vLLM's last rank builds embed_tokens for its head
    e = inference_estimate(gpt2, StepSpec(batch=1, seq=512, precision="bf16"), parallel=ParallelSpec(pp=2),
                           context=1024)
    one = inference_estimate(gpt2, StepSpec(batch=1, seq=512, precision="bf16"), context=1024)
    assert sum(r.totals_bytes["parameter"] for r in e.ranks) == _params(one) + 50257 * 768 * 2


def test_linear_formats_exact():
    o, i = 4096, 4096
    assert linear_bytes("bf16", o, i) == linear_bytes("fp16", o, i) == o * i * 2
    assert linear_bytes("fp8", o, i) == o * i + 4                 # one fp32 per-tensor scale
    assert linear_bytes("int8", o, i) == o * i + o * 4            # fp32 scale per output channel
    # int4 G=128: 16,777,216 weights / 2 = 8 MiB packed + 32 groups·4096 fp16 scales + 32·4096/2 packed zeros
    assert linear_bytes("int4", o, i, 128) == 8388608 + 262144 + 65536
    with pytest.raises(SpecError, match="weight_group"):
        linear_bytes("int4", o, 4000, 128)


def test_int4_equals_autoawq_buffers_allocated_with_torch():
    # AutoAWQ WQLinear_GEMM.__init__ registers qweight int32 [in, out/8], qzeros int32 [in/G, out/8],
    # scales fp16 [in/G, out]; allocate them and count.
    inp, out, G = 4096, 14336, 128
    bufs = [torch.empty(inp, out // 8, dtype=torch.int32), torch.empty(inp // G, out // 8, dtype=torch.int32),
            torch.empty(inp // G, out, dtype=torch.float16)]
    assert linear_bytes("int4", out, inp, G) == sum(b.nbytes for b in bufs)


def test_weight_formats_quantize_block_linears_only():
    bf16 = _params(inference_estimate(L3, BF16, context=2048, weights="bf16"))
    int8 = _params(inference_estimate(L3, BF16, context=2048, weights="int8"))
    int4 = _params(inference_estimate(L3, BF16, context=2048, weights="int4", weight_group=128))
    lin_out_in = [(4096, 4096), (1024, 4096), (1024, 4096), (4096, 4096), (14336, 4096), (14336, 4096), (4096, 14336)]
    dense = (2 * 128256 * 4096 + 4096 + 32 * 2 * 4096) * 2  # embedding, head, norms stay bf16
    assert bf16 == dense + 32 * sum(o * i * 2 for o, i in lin_out_in)
    assert int8 == dense + 32 * sum(o * i + o * 4 for o, i in lin_out_in)
    assert int4 == dense + 32 * sum(o * i // 2 + (i // 128) * o * 2 + (i // 128) * o // 2 for o, i in lin_out_in)
    tp2 = _params(inference_estimate(L3, BF16, parallel=ParallelSpec(tp=2), context=2048, weights="int4"))
    # row-parallel o/down: groups along the rank's input half
    lin_tp2 = [(2048, 4096), (512, 4096), (512, 4096), (4096, 2048), (7168, 4096), (7168, 4096), (4096, 7168)]
    assert tp2 == (2 * 64128 * 4096 + 4096 + 32 * 2 * 4096) * 2 + 32 * sum(
        o * i // 2 + (i // 128) * o * 2 + (i // 128) * o // 2 for o, i in lin_tp2)


def test_quantizing_an_unmodelled_layout_is_refused():
    with pytest.raises(SpecError, match="not a Llama-style projection"):  # GPT-2: wte, a fused c_attn Conv1D
        inference_estimate(load_model("gpt2"), StepSpec(batch=1, seq=512), context=512, weights="int4")


def test_kv_dtype_fp8_halves_the_cache():
    bf = inference_estimate(L3, BF16, context=4096, kv_dtype="bf16").totals_bytes["kv_cache"]
    f8 = inference_estimate(L3, BF16, context=4096, kv_dtype="fp8").totals_bytes["kv_cache"]
    assert bf == 2 * 32 * 4096 * 8 * 128 * 2 and f8 == 2 * 32 * 4096 * 8 * 128 * 1


def test_chunked_prefill_runs_n_tokens_and_caches_the_context():
    step = StepSpec(batch=2, seq=8192, precision="bf16")
    whole = inference_estimate(L3, step, context=8192)
    chunk = inference_estimate(L3, step, context=8192, prefill_chunk=512)
    pw, pc = (next(p for p in e.phases if p.name == "prefill") for e in (whole, chunk))
    assert pc.parts["kv_cache"] == pw.parts["kv_cache"] == 2 * 32 * 2 * 8192 * 8 * 128 * 2
    assert pc.parts["residual"] == 2 * 512 * 4096 * 2
    # the MLP's gate, act and up of 512 tokens: 3 · B·N·F·2
    assert pc.parts["block_live"] == 3 * 2 * 512 * 14336 * 2
    assert pc.bytes < pw.bytes
    with pytest.raises(SpecError, match="prefill_chunk"):
        inference_estimate(L3, step, ImplSpec(attention="eager"), context=8192, prefill_chunk=512)


def test_capacity_is_vllms_block_count():
    gpu = load_gpu("h100-80gb", memory_only=True)
    e = inference_estimate(L3, BF16, context=8192, gpu=gpu)
    c = e.capacity
    no_kv_peak = max(p.bytes - p.parts["kv_cache"] for p in e.phases)
    block = 2 * 32 * 16 * 8 * 128 * 2  # 2 MiB: K and V, 32 layers, 16 tokens, 8 heads, 128, bf16
    assert c.block_bytes == block
    assert c.blocks == (int(gpu.memory_bytes * 0.9) - gpu.context_bytes - no_kv_peak) // block
    assert c.sequences == c.blocks // (8192 // 16)
    half = inference_estimate(L3, BF16, context=8192, gpu=gpu, kv_dtype="fp8").capacity
    assert half.block_bytes == block // 2 and half.blocks >= 2 * c.blocks
    # pp=2: each stage's block is 16 layers; the executor keeps the fewest blocks of its workers
    e2 = inference_estimate(L3, BF16, parallel=ParallelSpec(pp=2), context=8192, gpu=gpu)
    per_stage = [(int(gpu.memory_bytes * 0.9) - gpu.context_bytes - NCCL_BYTES  # two GPUs: NCCL's buffers too
                  - max(p.bytes - p.parts["kv_cache"] for p in r.phases)) // (block // 2) for r in e2.ranks]
    assert e2.capacity.blocks == min(per_stage) and e2.capacity.gpus == 2


def test_real_llama_dynamic_cache_and_tp_shards_equal_the_estimate():
    from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

    from trainmem.specs.loaders import spec_from_hf_config

    cfg = dict(model_type="llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
               num_attention_heads=8, num_key_value_heads=2, vocab_size=1000, tie_word_embeddings=False)
    model = LlamaForCausalLM(LlamaConfig(**{k: v for k, v in cfg.items() if k != "model_type"})).to(torch.bfloat16)
    spec = spec_from_hf_config(cfg)
    B, S = 3, 40
    cache = DynamicCache()
    with torch.no_grad():
        model(torch.randint(0, 1000, (B, S)), past_key_values=cache, use_cache=True)
    real = sum(layer.keys.nbytes + layer.values.nbytes for layer in cache.layers)
    est = inference_estimate(spec, StepSpec(batch=B, seq=S, precision="bf16"), context=S, block_size=1)
    assert est.totals_bytes["kv_cache"] == real == 2 * 2 * B * S * 2 * 8 * 2
    assert est.totals_bytes["parameter"] == sum(p.nbytes for p in model.parameters())
    # TP=4 > 2 kv heads: shard rank 0's tensors by the rule (column rows, row columns, vocab rows,
    # KV head rank // (tp / Akv) replicated) from the real parameters
    tp, hd = 4, 8
    shard = 0
    for name, p in model.named_parameters():
        mod = name.rsplit(".", 2)[-2]
        if mod in ("q_proj", "gate_proj", "up_proj", "embed_tokens", "lm_head"):
            part = p[: -(-p.shape[0] // tp)]
        elif mod in ("k_proj", "v_proj"):
            head = 0 // (tp // 2)
            part = p[head * hd:(head + 1) * hd]
        elif mod in ("o_proj", "down_proj"):
            part = p[:, : p.shape[1] // tp]
        else:
            part = p
        shard += part.nbytes
    est4 = inference_estimate(spec, StepSpec(batch=B, seq=S, precision="bf16"), parallel=ParallelSpec(tp=tp),
                              context=S, block_size=1)
    assert est4.totals_bytes["parameter"] == shard
    assert est4.totals_bytes["kv_cache"] == real // 2  # one of two heads per rank
