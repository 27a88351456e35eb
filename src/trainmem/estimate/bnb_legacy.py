"""bitsandbytes < 0.43.2: ``MatMul4Bit`` holds each 4-bit linear's input until the graph is freed.

``FinetuneSpec.quant_impl = "bnb-legacy"`` (``--quant-impl bnb-legacy``): the storage of a 4-bit
weight is bitsandbytes' ``Params4bit`` as with ``bnb`` (:mod:`trainmem.estimate.quant4bit`); what
changes is the autograd function. In bitsandbytes 0.41.x-0.43.1, ``MatMul4Bit.forward``
(``bitsandbytes/autograd/_functions.py``) ends with::

    if any(ctx.needs_input_grad[:2]): ctx.tensors = (A, B)   # else (None, None)

although its backward reads only ``B`` (the packed weight, a parameter) to make ``grad_A``.
PR #1270 ("fix QLoRA mem bug: delete useless buffered activation", commit 9e75374, released in
0.43.2) stores ``(None, B)`` instead. ``A`` is ``Linear4bit.forward``'s ``x.to(compute_dtype)``
(``bitsandbytes/nn/modules.py``): the layer input itself when it already has the compute dtype,
else a new tensor. ``B`` is frozen, so ``A`` is held exactly when the input requires a gradient
(LoRA makes every block's input after the first adapted layer require one).

Two consequences, both modelled here:

* the saved set gains every such ``A`` (a tensor some other op already keeps is counted once: it
  is one storage), and
* ``ctx.tensors`` is a plain attribute, not ``save_for_backward``: backward does not release it,
  so these inputs stay alive through the whole backward, until the graph itself is freed.
  :func:`with_held_inputs` adds back, in each backward phase, the held inputs the phase model
  would otherwise drain block by block. The graph is taken as freed after backward (a loop that
  drops ``loss``, as HF Trainer's ``training_step`` does), except under ``--loss litgpt-chunked-ce``,
  which models LitGPT's loop: ``finetune/lora.py`` keeps ``logits`` and ``loss`` bound (both hold
  the graph) through the optimizer step and rebinds ``loss`` only after the next forward, so the
  previous step's held set is alive at the end of the next forward -- the bug's effect doubles.

Refused: under activation checkpointing (the attribute escapes the checkpoint's saved-tensor
hooks, so the held input would survive the region; not modelled), and with more than one device.
Old bitsandbytes has no CPU path (its 4-bit kernels are CUDA-only), so the rule is checked on CPU
as "bitsandbytes 0.50.2's real saved set plus every 4-bit linear input that requires a gradient"
(tests/finetune/test_bnb_legacy.py), not by running the old kernel.
"""

from __future__ import annotations

from dataclasses import replace

from trainmem.errors import UnsupportedError
from trainmem.estimate.graph import Key, Sym
from trainmem.estimate.peak import Phase, layer_stats
from trainmem.inventory import Category, Inventory, MemoryItem
from trainmem.names import is_head, layer_of

__all__ = ["HELD_NOTE", "LEGACY", "hold_input", "mark_held", "with_held_inputs"]

LEGACY = "bnb-legacy"
HELD_NOTE = ("held by bitsandbytes < 0.43.2 MatMul4Bit (ctx.tensors = (A, B)) until the graph is freed; "
             "fixed in 0.43.2, PR #1270")


def hold_input(ctx, a: Sym, held: dict[Key, Sym]) -> None:
    """``MatMul4Bit.forward`` of bitsandbytes < 0.43.2 keeps its input ``a`` (already cast to the
    compute dtype) when it requires a gradient; ``held`` collects it for :func:`mark_held`."""
    if not a.requires_grad:
        return
    if ctx.impl.recompute != "none":
        raise UnsupportedError(f"quant_impl {LEGACY!r} with recompute={ctx.impl.recompute!r} is not modelled: the "
                               "buffered input is a ctx attribute, outside the checkpoint's saved-tensor hooks")
    ctx.graph.save(a)
    held[ctx.graph.key(a)] = a


def mark_held(items: list[MemoryItem], keys: list[Key], held: dict[Key, Sym]) -> list[MemoryItem]:
    """``items`` (one per saved tensor, keyed like ``keys``) with the held ones' note set."""
    return [replace(it, note=HELD_NOTE) if k in held else it for it, k in zip(items, keys)]


def _held_bytes(inv: Inventory) -> tuple[dict[int, int], int]:
    """Held bytes per block index, and outside the blocks in the head (a 4-bit output head)."""
    per_layer: dict[int, int] = {}
    head = 0
    for it in inv:
        if it.category is not Category.ACTIVATION or it.note != HELD_NOTE:
            continue
        li = layer_of(it.name)
        if li is not None:
            per_layer[li] = per_layer.get(li, 0) + it.bytes
        elif is_head(it.name):
            head += it.bytes
    return per_layer, head


def with_held_inputs(phases: list[Phase], inv: Inventory, *, loop_holds_graph: bool = False) -> list[Phase]:
    """Add back, in the backward phases, the held inputs that :func:`trainmem.estimate.peak.phases`
    drains: ``backward`` drops the head's activations, ``backward_first_block`` every block's but
    the first, ``backward_end`` all. The forward phases count them already (they are activations);
    the optimizer runs after the graph is freed -- unless ``loop_holds_graph``: LitGPT's loop
    (``litgpt-chunked-ce``: ``logits`` and ``loss`` stay bound) holds the graph through the optimizer
    step and into the next step's forward, until the new ``loss`` is bound, so the optimizer phase
    holds this step's set and the end of forward (inside the loss) the previous step's too, taken
    at the same B and S (the steady state; a longer previous batch holds more, a shorter one less)."""
    per_layer, head = _held_bytes(inv)
    if not per_layer and not head:
        return phases
    first = min(layer_stats(inv).act_layer, default=None)  # the block phases() calls first
    total = head + sum(per_layer.values())
    add_by_phase = {
        "backward": head,
        "backward_first_block": head + sum(b for li, b in per_layer.items() if li != first),
        "backward_end": total,
    }
    if loop_holds_graph:
        add_by_phase.update(forward=total, optimizer=total)
    out = []
    for p in phases:
        add = add_by_phase.get(p.name, 0)
        if add:
            p = Phase(p.name, p.bytes + add, {**p.parts, "activations": p.parts.get("activations", 0) + add},
                      f"{p.note}; + 4-bit linear inputs bitsandbytes < 0.43.2 holds until the graph is freed"
                      + (" (the previous step's: the loop still holds its graph)" if p.name == "forward" else ""))
        out.append(p)
    return out
