"""gpt-oss under ``--recompute op`` (torchtitan's op-level policy, ``trace/recompute.py`` ``op_sac_context``).

Each checkpointed block keeps its inputs and the outputs of the ops on the policy's save list: the
biased q/k/v/o projections and the router's linear (aten.addmm: kept, not counted as mm's), eager
attention's two aten.bmm (``Q·Kᵀ`` and ``P·V``, ``modeling_gpt_oss.eager_attention_forward``) and
both outputs of the router's ``torch.topk`` (``GptOssTopKRouter.forward``). Its ``amax`` is
``combined_logits.max(dim=-1)``, aten.max.dim, not the policy's aten.max.default: recomputed; the
``grouped_mm`` experts (aten._grouped_mm, not a compute-intensive op for the partitioner) are
recomputed whole. Checked against what a real op-checkpointed CPU forward leaves alive (slow, one
real model each) and, in ``test_rules_hybrid.py``, against ``--profile traced`` (bf16: the
``_grouped_mm`` meta kernel runs in bf16 only)."""

from __future__ import annotations

import pytest

from trainmem.estimate.activations import activation_items
from trainmem.specs import ImplSpec, StepSpec
from trainmem.specs.loaders import spec_from_hf_config

from kinds_configs import CONFIGS  # noqa: E402

B, S = 2, 64  # kinds_configs: H=64, A=4, Akv=2, hd=16, E=4, k=2, window 16


def _items(precision: str, recompute: str = "op") -> dict[str, int]:
    items = activation_items(spec_from_hf_config(CONFIGS["gpt_oss"]), StepSpec(batch=B, seq=S, precision=precision),
                             ImplSpec(attention="eager", recompute=recompute, device="cpu"))
    return {i.name: i.bytes for i in items}


def test_a_block_keeps_the_policy_outputs():
    items = _items("bf16")
    block = {n[len("model.layers.0."):]: b for n, b in items.items() if n.startswith("model.layers.0.")}
    T = B * S
    assert block == {
        "self_attn.q_proj.out": T * 64 * 2, "self_attn.k_proj.out": T * 32 * 2, "self_attn.v_proj.out": T * 32 * 2,
        "self_attn.scores": B * 4 * S * S * 2,  # Q·Kᵀ's bmm (B·A, S, S), without the sink column
        "self_attn.pv": B * 4 * S * 16 * 2,  # P·V's bmm
        "self_attn.o_proj.out": T * 64 * 2,
        "mlp.router.out": T * 4 * 2,  # the router's addmm (B·S, E)
        "mlp.router.top_val": T * 2 * 2, "mlp.router.top_idx": T * 2 * 8,  # topk's values and int64 indices
        "residual_mlp": T * 64 * 2,  # the next block's input
    }
    # what the checkpoint's recompute rebuilds is not kept: the softmax with the sinks, the experts
    assert not [n for n in items if n.startswith("model.layers.") and any(
        w in n for w in ("softmax", "experts", "max_idx"))]
    # the second block's checkpoint holds the block inputs (hidden state, cos, sin, position ids, its mask)
    assert {"model.rotary_emb.cos", "model.rotary_emb.sin", "model.position_ids", "model.causal_mask",
            "model.sliding_window_mask"} <= set(items)


SLOW = pytest.mark.slow


def _alive_after_forward(precision: str) -> int:
    """Bytes of every storage a real op-checkpointed CPU forward leaves alive, the token ids and the
    loss value the caller holds included (parameters and buffers not), the router forced to the
    estimate's balanced assignment (every routed tensor has B·S·k rows: the assignment changes nothing)."""
    import torch

    from trainmem.models.hf import build_hf_model
    from trainmem.trace.live import LiveStorages
    from trainmem.trace.recompute import op_sac_context
    from trainmem.trace.routing import force_routing
    from trainmem.trace.storages import storage_key

    cfg = CONFIGS["gpt_oss"]
    torch.manual_seed(0)
    model = build_hf_model(cfg, attention="eager", dtype=torch.bfloat16 if precision == "bf16" else None)
    model.gradient_checkpointing_enable(
        gradient_checkpointing_kwargs={"use_reentrant": False, "context_fn": op_sac_context})
    ids = torch.randint(0, cfg["vocab_size"], (B, S))
    resident = [storage_key(t) for t in (*model.parameters(), *model.buffers())]
    with force_routing(model, 0.0), LiveStorages(skip_keys=resident) as live:
        live.track(ids)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "amp-bf16"):
            loss = model(ids, labels=ids).loss
        alive = live.now
    assert loss.numel() == 1
    return alive


@SLOW
@pytest.mark.parametrize("precision", ["bf16", "fp32", "amp-bf16"])
def test_op_recompute_equals_what_the_forward_keeps(precision):
    """Measured: bf16 677,896 B, fp32 1,027,080 B, amp-bf16 809,480 B (the 4-byte fp32 loss value included)."""
    assert sum(_items(precision).values()) == _alive_after_forward(precision)
