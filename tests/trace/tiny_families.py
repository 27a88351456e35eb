"""Tiny configs of the model families issue 14 lists, as transformers 5.x reads them.

Hidden 64, 2 layers, vocabulary 512, MoE with 4 experts and top-2: small enough to build and step
on CPU in well under a second each.
"""

DENSE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=512, max_position_embeddings=512, pad_token_id=0)
MOE = dict(DENSE, moe_intermediate_size=32, num_experts_per_tok=2)

#: model_type -> config.json dict (the dict a user's file would hold).
FAMILIES = {
    # decoders with a causal-LM head
    "olmo2": dict(DENSE),
    "olmo3": dict(DENSE, sliding_window=64),
    "phi": dict(DENSE),
    "falcon": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, vocab_size=512),
    "starcoder2": dict(DENSE),
    "gpt_bigcode": dict(n_embd=64, n_layer=2, n_head=4, vocab_size=512, n_positions=512),
    "granite": dict(DENSE),
    "cohere": dict(DENSE),
    "cohere2": dict(DENSE, sliding_window=64),
    "glm4": dict(DENSE, head_dim=16),
    "smollm3": dict(DENSE),
    "stablelm": dict(DENSE),
    "exaone4": dict(DENSE, sliding_window=64),
    "ernie4_5": dict(DENSE, head_dim=16),
    "hunyuan_v1_dense": dict(DENSE, head_dim=16),
    "gemma3_text": dict(DENSE, head_dim=16, sliding_window=64),
    # mixture of experts
    "qwen3_moe": dict(MOE, num_experts=4, head_dim=16),
    "qwen2_moe": dict(MOE, num_experts=4, shared_expert_intermediate_size=64),
    "deepseek_v2": dict(MOE, num_key_value_heads=4, n_routed_experts=4, n_shared_experts=1, first_k_dense_replace=1, kv_lora_rank=16,
                        q_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, n_group=2,
                        topk_group=1),
    "deepseek_v3": dict(MOE, num_key_value_heads=4, n_routed_experts=4, n_shared_experts=1, first_k_dense_replace=1, kv_lora_rank=16,
                        q_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, n_group=2,
                        topk_group=1, head_dim=8),
    "glm4_moe": dict(MOE, n_routed_experts=4, n_shared_experts=1, first_k_dense_replace=1, n_group=1, topk_group=1,
                     head_dim=16),
    "hunyuan_v1_moe": dict(DENSE, head_dim=16, num_experts=4, moe_topk=2),
    "minimax": dict(DENSE, num_local_experts=4, num_experts_per_tok=2, head_dim=16,
                    layer_types=["full_attention", "linear_attention"]),
    "qwen3_next": dict(MOE, num_experts=4, shared_expert_intermediate_size=64, head_dim=16,
                       linear_key_head_dim=16, linear_value_head_dim=16, linear_num_key_heads=2,
                       linear_num_value_heads=4, layer_types=["linear_attention", "full_attention"]),
    "gpt_oss": dict(DENSE, num_local_experts=4, num_experts_per_tok=2, head_dim=16,
                    layer_types=["sliding_attention", "full_attention"], sliding_window=64),
    "llama4_text": dict(DENSE, intermediate_size_mlp=128, num_local_experts=4, num_experts_per_tok=1, head_dim=16,
                        attention_chunk_size=64),
    # encoders with a masked-LM head
    "roberta": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                    vocab_size=512, max_position_embeddings=514),
    "modernbert": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                       vocab_size=512, max_position_embeddings=512, local_attention=64, pad_token_id=0),
    "deberta-v2": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                       vocab_size=512, max_position_embeddings=512),
    # encoder-decoder (labels feed the decoder)
    "t5": dict(d_model=64, d_ff=128, d_kv=16, num_layers=2, num_decoder_layers=2, num_heads=4, vocab_size=512,
             pad_token_id=0, decoder_start_token_id=0, eos_token_id=1),
}
for _name, _cfg in FAMILIES.items():
    _cfg["model_type"] = _name

MOE_FAMILIES = ("qwen3_moe", "qwen2_moe", "deepseek_v2", "deepseek_v3", "glm4_moe", "hunyuan_v1_moe", "minimax",
                "qwen3_next", "gpt_oss", "llama4_text")
