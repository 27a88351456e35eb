"""Mixtral and Qwen3-MoE under ``--recompute op`` (torchtitan's op-level policy, ``op_sac_context``),
checked against the real mechanism on CPU: what a checkpointed forward leaves alive equals the hf
rules to the byte. The router's ``torch.topk`` is on the policy's save list, so each block keeps
both of its outputs, the fp32 values and the int64 indices: B·S·k·(4 + 8) = 2·64·2·12 = 3,072 B a
block that the rules missed before (-6,144 B on two blocks, every precision and kernel)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from trainmem.estimate.activations import activation_items  # noqa: E402
from trainmem.specs import ImplSpec, StepSpec  # noqa: E402
from trainmem.specs.loaders import spec_from_hf_config  # noqa: E402

B, S = 2, 64
SMALL = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, vocab_size=500)
CONFIGS = {
    "mixtral": dict(model_type="mixtral", intermediate_size=96, num_local_experts=4, num_experts_per_tok=2, **SMALL),
    "qwen3_moe": dict(model_type="qwen3_moe", intermediate_size=176, moe_intermediate_size=32, num_experts=4,
                      num_experts_per_tok=2, head_dim=16, norm_topk_prob=True, **SMALL),
    # no renormalization: autograd keeps no top-k values, the policy still keeps topk's outputs
    "qwen3_moe-unnormed": dict(model_type="qwen3_moe", intermediate_size=176, moe_intermediate_size=32,
                               num_experts=4, num_experts_per_tok=2, head_dim=16, norm_topk_prob=False, **SMALL),
}


def _kept_by_forward(cfg: dict, precision: str, attention: str) -> int:
    """Bytes of the storages a real op-checkpointed forward leaves alive (the loss included, the
    ids counted once), the router forced to the estimate's balanced assignment."""
    from trainmem.models.hf import build_hf_model
    from trainmem.trace.live import LiveStorages
    from trainmem.trace.routing import force_routing
    from trainmem.trace.recompute import op_sac_context
    from trainmem.trace.storages import storage_key

    torch.manual_seed(0)
    model = build_hf_model(cfg, attention=attention, dtype=torch.bfloat16 if precision == "bf16" else None)
    model.gradient_checkpointing_enable(
        gradient_checkpointing_kwargs={"use_reentrant": False, "context_fn": op_sac_context})
    ids = torch.randint(0, cfg["vocab_size"], (B, S))
    skip = [storage_key(t) for t in (*model.parameters(), *model.buffers(), ids)]
    with force_routing(model, 0.0), LiveStorages(skip_keys=skip) as live:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "amp-bf16"):
            loss = model(ids, labels=ids).loss
    assert loss.untyped_storage().nbytes() == 4  # the fp32 loss the caller holds: the estimate's loss.value
    return live.now + ids.untyped_storage().nbytes()


def _items(cfg: dict, precision: str, attention: str, recompute: str = "op") -> dict[str, int]:
    items = activation_items(spec_from_hf_config(cfg), StepSpec(batch=B, seq=S, precision=precision),
                             ImplSpec(attention=attention, recompute=recompute, device="cpu"))
    return {i.name: i.bytes for i in items}


SLOW = pytest.mark.slow
CASES = [("mixtral", "fp32", "sdpa"), ("qwen3_moe", "bf16", "eager")] + [
    pytest.param(*c, marks=SLOW) for c in [("mixtral", "bf16", "eager"), ("mixtral", "amp-bf16", "sdpa"),
                                           ("qwen3_moe", "amp-bf16", "sdpa"), ("qwen3_moe", "fp32", "eager"),
                                           ("qwen3_moe-unnormed", "bf16", "sdpa")]]


@pytest.mark.parametrize("family,precision,attention", CASES)
def test_op_recompute_equals_what_the_forward_keeps(family, precision, attention):
    cfg = CONFIGS[family]
    assert sum(_items(cfg, precision, attention).values()) == _kept_by_forward(cfg, precision, attention)


@pytest.mark.parametrize("family", list(CONFIGS))
def test_the_policy_keeps_both_topk_outputs(family):
    items = _items(CONFIGS[family], "bf16", "sdpa")
    # B·S·k = 2·64·2 = 256 rows: fp32 values 1,024 B, int64 indices 2,048 B
    assert items["model.layers.0.mlp.gate.top_val"] == 1024
    assert items["model.layers.0.mlp.gate.top_idx"] == 2048
    # the mm's kept are counted as before: q (1st), v (3rd), the router's linear (5th)
    assert items["model.layers.0.mlp.gate.out"] == 2 * 64 * 4 * 2
    assert "model.layers.0.mlp.gate.probs" not in items  # softmax is recomputed
    # without recompute autograd keeps the indices, and the values only where they are renormalized
    plain = _items(CONFIGS[family], "bf16", "sdpa", "none")
    assert plain["model.layers.0.mlp.gate.top_idx"] == 2048
    assert ("model.layers.0.mlp.gate.top_val" in plain) == CONFIGS[family].get("norm_topk_prob", True)
