"""Tiny configs of the families whose blocks differ (layer kinds), each kind present, and the
kinds transformers builds from them (``LayerKind.label`` per block)."""

TINY = dict(hidden_size=64, num_attention_heads=4, vocab_size=500)
CONFIGS = {
    "gemma3_text": dict(model_type="gemma3_text", intermediate_size=128, num_hidden_layers=4, num_key_value_heads=2,
                        head_dim=16, sliding_window=16, sliding_window_pattern=2, **TINY),
    "gpt_oss": dict(model_type="gpt_oss", intermediate_size=32, num_hidden_layers=2, num_key_value_heads=2,
                    head_dim=16, num_local_experts=4, num_experts_per_tok=2, sliding_window=16, **TINY),
    "deepseek_v3": dict(model_type="deepseek_v3", intermediate_size=128, moe_intermediate_size=32,
                        num_hidden_layers=3, num_key_value_heads=4, n_routed_experts=4, num_experts_per_tok=2,
                        n_shared_experts=1, first_k_dense_replace=1, q_lora_rank=32, kv_lora_rank=16,
                        qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, n_group=1, topk_group=1, **TINY),
    "deepseek_v2": dict(model_type="deepseek_v2", intermediate_size=128, moe_intermediate_size=32,
                        num_hidden_layers=3, n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=2,
                        first_k_dense_replace=2, q_lora_rank=None, kv_lora_rank=16, qk_nope_head_dim=16,
                        qk_rope_head_dim=8, v_head_dim=16, **TINY),
    "llama4_text": dict(model_type="llama4_text", intermediate_size=32, intermediate_size_mlp=128,
                        num_hidden_layers=4, num_key_value_heads=2, head_dim=16, num_local_experts=4,
                        num_experts_per_tok=1, interleave_moe_layer_step=2, attention_chunk_size=16, **TINY),
    "qwen3_next": dict(model_type="qwen3_next", intermediate_size=128, moe_intermediate_size=32,
                       shared_expert_intermediate_size=48, num_hidden_layers=4, num_key_value_heads=2, head_dim=16,
                       num_experts=4, num_experts_per_tok=2, mlp_only_layers=[1], linear_num_value_heads=4,
                       linear_num_key_heads=2, linear_key_head_dim=16, linear_value_head_dim=16, **TINY),
}
KINDS = {  # LayerKind.label of each block, as transformers builds them
    "gemma3_text": ["sliding(16)", "full", "sliding(16)", "full"],
    "gpt_oss": ["sliding(16)+moe", "full+moe"],
    "deepseek_v3": ["full", "full+moe", "full+moe"],
    "deepseek_v2": ["full", "full", "full+moe"],
    "llama4_text": ["chunked(16)", "chunked(16)+moe", "chunked(16)", "full/nope+moe"],
    "qwen3_next": ["linear+moe", "linear", "linear+moe", "full+moe"],
}


B, S = 2, 64  # a 16-token window, so local blocks see a quarter of the sequence


def _measured(cfg: dict, precision: str, attention: str, recompute: str = "none") -> tuple[int, list]:
    """What autograd keeps in a real CPU forward: saved-tensor hooks, or (checkpointing) the
    storages still alive after it; with the loss the caller holds (the estimate's ``loss.value``)."""
    import torch

    from trainmem.models.hf import build_hf_model
    from trainmem.trace.saved import retained_bytes, saved_tensors

    torch.manual_seed(0)
    model = build_hf_model(cfg, attention=attention, dtype=torch.bfloat16 if precision == "bf16" else None)
    if recompute == "full":
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if recompute == "every-k":  # blocks 0, 2, 4, ... as the measurement checkpoints them
        from trainmem.specs import ImplSpec
        from trainmem.trace.recompute import enable_recompute

        enable_recompute(model, ImplSpec(recompute="every-k", recompute_every=2))
    ids = torch.randint(0, cfg["vocab_size"], (B, S))
    amp = torch.bfloat16 if precision == "amp-bf16" else None

    def forward():
        with torch.autocast("cpu", dtype=amp, enabled=amp is not None):
            return model(ids, labels=ids).loss

    if recompute == "selective":  # checkpoint each attention function call, as the measurement does
        from trainmem.trace.recompute import selective_recompute

        plain = forward

        def forward():
            with selective_recompute(model, attention):
                return plain()
    saved, loss = saved_tensors(model, forward, buffers=False)  # a saved buffer is the buffer item
    if recompute == "none":
        return sum(s.nbytes for s in saved) + loss.untyped_storage().nbytes(), saved
    retained, loss = retained_bytes(model, forward)
    return retained + ids.untyped_storage().nbytes(), saved


def check_against_autograd(cfg: dict, precision: str, attention: str, recompute: str = "none"):
    """The estimate's activations == autograd's, to the byte; returns the estimate's items."""
    from trainmem.estimate.activations import activation_items
    from trainmem.specs import ImplSpec, StepSpec
    from trainmem.specs.loaders import spec_from_hf_config
    from trainmem.trace.saved import explain_difference

    measured, saved = _measured(cfg, precision, attention, recompute)
    items = activation_items(spec_from_hf_config(cfg), StepSpec(batch=B, seq=S, precision=precision),
                             ImplSpec(attention=attention, recompute=recompute, device="cpu",
                                      recompute_every=2 if recompute == "every-k" else 1))
    estimated = sum(i.bytes for i in items)
    assert estimated == measured, f"estimate {estimated} vs measured {measured}; {explain_difference(items, saved)}"
    return items


def check_against_traced(cfg: dict, tmp_path, precision: str, attention: str, seq: int = 64) -> None:
    """``--profile traced`` and the hf rules agree to the byte (totals and peak) at B=2; point
    ``TRAINMEM_CACHE`` at a temporary folder first (``monkeypatch.setenv``)."""
    import json

    from trainmem.estimate import estimate
    from trainmem.specs import ImplSpec, StepSpec
    from trainmem.specs.loaders import load_model

    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    model, step = load_model(str(path)), StepSpec(batch=B, seq=seq, precision=precision)
    traced = estimate(model, step, ImplSpec(profile="traced", device="cpu", attention=attention))
    ruled = estimate(model, step, ImplSpec(profile="hf", device="cpu", attention=attention))
    assert traced.totals_bytes == ruled.totals_bytes
    assert traced.peak_bytes == ruled.peak_bytes
