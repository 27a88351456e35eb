"""Activation inventory: dispatch to the profile's block rules and collect what is saved."""

from __future__ import annotations

from trainmem.estimate.ctx import Ctx
from trainmem.estimate.graph import Graph
from trainmem.inventory import MemoryItem
from trainmem.specs import ImplSpec, ModelSpec, StepSpec

__all__ = ["activation_items"]


def activation_items(model: ModelSpec, step: StepSpec, impl: ImplSpec) -> list[MemoryItem]:
    """Every tensor kept for backward during one micro-batch's forward and loss."""
    ctx = Ctx(Graph(), model, step, impl)
    if impl.profile == "hf":
        from trainmem.estimate.rules_hf import hf_forward as forward
    elif impl.profile == "reference":
        from trainmem.estimate.rules_reference import reference_forward as forward
    else:
        from trainmem.estimate.rules_megatron import megatron_forward as forward
    ctx.g.save(ctx.g.new("input_ids", (step.batch, step.seq), "B·S", "int64")) if impl.profile != "hf" else None
    forward(ctx)
    return ctx.g.items()
