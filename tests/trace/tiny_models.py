"""Tiny Hugging Face configs and a MemTracker reference for the tracer tests."""

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

LLAMA = dict(model_type="llama", hidden_size=64, intermediate_size=176, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=4, vocab_size=1000, max_position_embeddings=256)
GPT2 = dict(model_type="gpt2", n_embd=64, n_layer=2, n_head=4, vocab_size=1000, n_positions=256,
            attn_pdrop=0.0, embd_pdrop=0.0, resid_pdrop=0.0)
QWEN2 = dict(model_type="qwen2", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, vocab_size=1000, max_position_embeddings=256)
MIXTRAL = dict(model_type="mixtral", hidden_size=64, intermediate_size=96, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, vocab_size=1000, max_position_embeddings=256,
               num_local_experts=4, num_experts_per_tok=2)


def memtracker_peak(config, *, batch, seq, attention="sdpa", dtype=None, checkpoint=False):
    """MemTracker's peak (logical bytes, CPU tensors are not rounded) on the second of two steps."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.mem_tracker import MemTracker

    from trainmem.models.hf import build_hf_model

    with FakeTensorMode():
        old = torch.get_default_dtype()
        torch.set_default_dtype(dtype or torch.float32)  # model.to() cannot swap fake parameters
        try:
            model = build_hf_model(config, attention=attention)
        finally:
            torch.set_default_dtype(old)
        if checkpoint:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
        ids = torch.randint(0, config.get("vocab_size", 1000), (batch, seq))

        def step():
            model(input_ids=ids, labels=ids).loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        step()
        mt = MemTracker()
        mt.track_external(model, opt, ids)
        with mt:
            step()
        return max(d["Total"] for d in mt.get_tracker_snapshot("peak").values())
