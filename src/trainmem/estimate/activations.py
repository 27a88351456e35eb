"""Activation inventory: dispatch to the profile's block rules and collect what is saved."""

from __future__ import annotations

from trainmem.estimate.ctx import Ctx
from trainmem.estimate.graph import Graph
from trainmem.inventory import MemoryItem
from trainmem.specs import ImplSpec, ModelSpec, StepSpec

__all__ = ["activation_items"]


def activation_items(model: ModelSpec, step: StepSpec, impl: ImplSpec, finetune=None) -> list[MemoryItem]:
    """Every tensor kept for backward during one micro-batch's forward and loss.

    ``finetune`` (a FinetuneSpec): frozen weights and LoRA adapters change the saved set; the
    inputs frozen layers do not keep are listed as zero-byte items with a note."""
    ctx = Ctx(Graph(), model, step, impl)
    hook = None
    if finetune is not None:
        from trainmem.estimate.finetune import FinetuneLinear, trainable_predicate
        ctx.trainable = trainable_predicate(model, finetune)
        ctx.finetune_linear = hook = FinetuneLinear(model, step, finetune)
    if impl.profile == "hf":
        from trainmem.estimate.rules_hf import hf_forward as forward
    elif impl.profile == "reference":
        from trainmem.estimate.rules_reference import reference_forward as forward
    else:
        from trainmem.estimate.rules_megatron import megatron_forward as forward
    ctx.g.save(ctx.g.new("input_ids", (step.batch, step.seq), "B·S", "int64")) if impl.profile != "hf" else None
    forward(ctx)
    if hook is None:
        return ctx.g.items()
    hook.embedding_notes(ctx, model)
    return ctx.g.items() + hook.notes
