"""Activation inventory: dispatch to the profile's block rules and collect what is saved."""

from __future__ import annotations

from trainmem.errors import SpecError
from trainmem.estimate.ctx import Ctx, Shard
from trainmem.estimate.graph import Graph
from trainmem.inventory import Inventory, MemoryItem
from trainmem.specs import ImplSpec, ModelSpec, StepSpec

__all__ = ["activation_items", "activation_items_with_savers", "activation_inventory"]


def activation_items(model: ModelSpec, step: StepSpec, impl: ImplSpec, finetune=None,
                     shard: Shard | None = None, *, kv_cache: bool = True,
                     checkpointed: bool = False) -> list[MemoryItem]:
    """Every tensor kept for backward during one micro-batch's forward and loss.

    ``finetune`` (a FinetuneSpec): frozen weights and LoRA adapters change the saved set; the
    inputs frozen layers do not keep are listed as zero-byte items with a note.
    ``shard``: one rank's cut under tensor/sequence/context parallelism (``model`` and ``step``
    are then the rank-local ones; see ``estimate/parallel.py``).
    ``kv_cache=False``: what a checkpointed block recomputes (checkpointing turns the cache off, Ctx.kv_cache);
    ``checkpointed``: under transformers' gradient checkpointing (Ctx.checkpointed)."""
    return activation_items_with_savers(model, step, impl, finetune, shard, kv_cache=kv_cache,
                                        checkpointed=checkpointed)[0]


def activation_inventory(model: ModelSpec, step: StepSpec, impl: ImplSpec, *, kv_cache: bool = True) -> Inventory:
    """:func:`activation_items` as an :class:`Inventory` whose identical blocks are stored once
    (fast for deep models; fine-tuning and parallel cuts use the item lists)."""
    ctx = Ctx(Graph(), model, step, impl, replicate=True, kv_cache=kv_cache)
    _input_ids(ctx)
    _forward(impl)(ctx)
    return ctx.graph.inventory()


def _input_ids(ctx: Ctx) -> None:
    """Non-HF profiles name the caller's token ids (the HF rules keep them under the embedding)."""
    if ctx.impl.profile != "hf":
        ctx.graph.save(ctx.graph.new("input_ids", (ctx.step.batch, ctx.step.seq), ("B", "S"), "int64"))


def _forward(impl: ImplSpec):
    if impl.compile:  # torch.compile's saved set (it refuses what it has not been checked on)
        from trainmem.estimate.rules_compiled import compiled_forward as forward
    elif impl.profile == "hf":
        from trainmem.estimate.rules_hf import hf_forward as forward
    elif impl.profile == "reference":
        from trainmem.estimate.rules_reference import reference_forward as forward
    elif impl.profile == "megatron":
        from trainmem.estimate.rules_megatron import megatron_forward as forward
    else:  # traced: no rules to run; estimate() reads the saved set off the trace (estimate/traced)
        raise SpecError("profile", impl.profile, "has no per-block rules: its activations come from "
                                                 "estimate() on one device (estimate/traced)")
    return forward


def activation_items_with_savers(model: ModelSpec, step: StepSpec, impl: ImplSpec, finetune=None,
                                 shard: Shard | None = None, *, kv_cache: bool = True, checkpointed: bool = False,
                                 ) -> tuple[list[MemoryItem], list[str]]:
    """:func:`activation_items` plus, for each item, the module scope that keeps it (a pipeline
    stage owns what its layers keep, whoever created it)."""
    ctx = Ctx(Graph(), model, step, impl, shard=shard or Shard(), kv_cache=kv_cache, checkpointed=checkpointed)
    hook = None
    if finetune is not None:
        from trainmem.estimate.finetune import FinetuneLinear, trainable_predicate
        finetune = finetune.for_model(model)  # lora_targets None: the family's default
        ctx.trainable = trainable_predicate(model, finetune)
        ctx.finetune_linear = hook = FinetuneLinear(model, step, finetune)
    _input_ids(ctx)
    _forward(impl)(ctx)
    if hook is None:
        return ctx.graph.items(), ctx.graph.savers()
    hook.embedding_notes(ctx, model)
    items = ctx.graph.items()
    if hook.held:  # bitsandbytes < 0.43.2: say which inputs MatMul4Bit holds (estimate/bnb_legacy.py)
        from trainmem.estimate.bnb_legacy import mark_held
        items = mark_held(items, list(ctx.graph.saved), hook.held)
    return items + hook.notes, ctx.graph.savers() + [""] * len(hook.notes)
