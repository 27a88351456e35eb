"""Every family's declared buffers (``Family.buffers``, ``families/buffers.py``) are the
``named_buffers()`` of a real transformers 5.24 build, name, shape and dtype, and the estimate
files them in its ``buffer`` ledger, resident in every phase."""

from __future__ import annotations

import pytest

from trainmem import families as F
from trainmem.estimate import estimate
from trainmem.estimate.buffers import buffer_items
from trainmem.inventory import Category
from trainmem.specs import ImplSpec, StepSpec
from trainmem.specs.loaders import spec_from_hf_config

DENSE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=512, max_position_embeddings=512, pad_token_id=0)
MOE = dict(DENSE, moe_intermediate_size=32, num_experts_per_tok=2)
MLA = dict(MOE, num_key_value_heads=4, n_routed_experts=4, n_shared_experts=1, first_k_dense_replace=1,
           kv_lora_rank=16, q_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, n_group=2,
           topk_group=1)
ENCODER = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, vocab_size=512,
               max_position_embeddings=512)
#: one tiny config per family with a config.json (generic has none)
CONFIGS = {
    "gpt2": dict(n_embd=64, n_layer=2, n_head=4, vocab_size=512, n_positions=512),
    "gpt_bigcode": dict(n_embd=64, n_layer=2, n_head=4, vocab_size=512, n_positions=512),  # bias: (512, 512) bool
    "gpt_neox": dict(ENCODER),  # rotary_pct 0.25: 4 of 16 head dims, 2 frequencies
    "llama": dict(DENSE), "mistral": dict(DENSE), "qwen2": dict(DENSE), "qwen3": dict(DENSE, head_dim=16),
    "mixtral": dict(DENSE, num_local_experts=4, num_experts_per_tok=2),
    "gemma": dict(DENSE, head_dim=16), "gemma2": dict(DENSE, head_dim=16),
    "phi3": dict(DENSE), "bert": dict(ENCODER), "olmo2": dict(DENSE),
    # six blocks: five sliding, one full, so both rotary pairs
    "gemma3_text": dict(DENSE, num_hidden_layers=6, head_dim=16, sliding_window=64),
    "deepseek_v2": dict(MLA), "deepseek_v3": dict(MLA, head_dim=8),
    "llama4_text": dict(DENSE, intermediate_size_mlp=128, num_local_experts=4, num_experts_per_tok=1, head_dim=16,
                        attention_chunk_size=64),
    "gpt_oss": dict(DENSE, num_local_experts=4, num_experts_per_tok=2, head_dim=16,
                    layer_types=["sliding_attention", "full_attention"], sliding_window=64),
    "qwen3_next": dict(MOE, num_experts=4, shared_expert_intermediate_size=64, head_dim=16, linear_key_head_dim=16,
                       linear_value_head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
                       layer_types=["linear_attention", "full_attention"]),
    "qwen3_moe": dict(MOE, num_experts=4, head_dim=16),
}
FAST = ("llama", "bert", "gemma")  # one model build each in the default run; the rest are slow


def test_every_family_with_a_config_is_checked():
    assert set(CONFIGS) == {f.name for f in F.families() if f.config is not None}


def _real(name: str, precision: str) -> dict:
    torch = pytest.importorskip("torch")
    from trainmem.models.hf import build_hf_model
    from trainmem.trace.torch_state import default_dtype

    # built under the precision's default dtype, as from_pretrained(dtype=...) and the tracer build it
    with default_dtype(torch.bfloat16 if precision == "bf16" else torch.float32):
        model = build_hf_model({**CONFIGS[name], "model_type": name}, attention="eager", init_weights=False)
    return {n: (tuple(b.shape), str(b.dtype).removeprefix("torch."), b.untyped_storage().nbytes())
            for n, b in model.named_buffers()}


def _declared(name: str, precision: str) -> dict:
    spec = spec_from_hf_config({**CONFIGS[name], "model_type": name})
    return {i.name: (i.shape, i.dtype, i.bytes) for i in buffer_items(spec, StepSpec(batch=1, seq=16, precision=precision))}


@pytest.mark.parametrize("name,precision", [
    pytest.param(n, p, marks=() if n in FAST else pytest.mark.slow)
    for n in CONFIGS for p in (("fp32", "bf16") if n in ("gemma", "deepseek_v3") else ("fp32",))])
def test_declared_buffers_are_the_real_named_buffers(name, precision):
    assert _declared(name, precision) == _real(name, precision)


def test_buffers_are_resident_in_every_phase():
    spec = spec_from_hf_config({**CONFIGS["llama"], "model_type": "llama"})
    e = estimate(spec, StepSpec(batch=1, seq=32, precision="bf16"), ImplSpec(device="cpu"))
    # LlamaRotaryEmbedding: inv_freq and original_inv_freq, hd/2 = 8 fp32 values each
    assert e.totals_bytes["buffer"] == 2 * 8 * 4
    assert all(p.parts["buffers"] == 64 for p in e.phases)
    without = sum(v for k, v in e.peak.parts.items() if k != "buffers")
    assert e.peak_bytes == without + 64


def test_bert_position_ids_and_the_pipeline_stages():
    """BERT's two (1, max_positions) int64 buffers sit on the embedding's stage; a rotary pair on every stage."""
    from trainmem.specs import ParallelSpec

    bert = spec_from_hf_config({**CONFIGS["bert"], "model_type": "bert"})
    assert estimate(bert, StepSpec(batch=1, seq=32), ImplSpec(device="cpu")).totals_bytes["buffer"] == 2 * 512 * 8
    llama = spec_from_hf_config({**CONFIGS["llama"], "model_type": "llama"})
    e = estimate(llama, StepSpec(batch=1, seq=32), ImplSpec(device="cpu"), ParallelSpec(pp=2))
    assert [sum(i.bytes for i in r.inventory if i.category is Category.BUFFER and i.name.startswith("model."))
            for r in e.ranks] == [64, 64]
