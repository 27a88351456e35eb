"""Tiny models for the measure tests (a helper, not a conftest: module names must be unique)."""

LLAMA = dict(model_type="llama", hidden_size=64, intermediate_size=176, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=4, vocab_size=1000, max_position_embeddings=1024)
GPT2 = dict(model_type="gpt2", n_embd=64, n_layer=2, n_head=4, vocab_size=1000, n_positions=256,
            attn_pdrop=0.0, embd_pdrop=0.0, resid_pdrop=0.0)


def reference_spec(**overrides):
    from dataclasses import replace

    from trainmem.specs.loaders import spec_from_hf_config
    return replace(spec_from_hf_config(LLAMA, name="tiny-llama"), **overrides)
