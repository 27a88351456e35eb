"""The peak is not a sum: model the step in phases and take the largest live set.

Phases of a steady-state step (optimizer state exists; gradients were zeroed with
``set_to_none``; only ``loss`` is kept from the outputs):

* ``forward``        -- end of forward, inside the loss: all saved activations, plus the logits
                        and their fp32 copy that the output object still holds.
* ``backward_start`` -- the loss backward: all activations, plus the gradient of the
                        log-softmax output and of the fp32 logits (two B·S·V·4 tensors).
* ``backward``       -- backward of the last block: head gradients exist, the last block's
                        recomputed activations (if checkpointed) and its gradient working set.
* ``backward_end``   -- every gradient exists, activations are gone.
* ``optimizer``      -- every gradient plus the optimizer's temporaries.

With gradient accumulation, gradients exist from the second micro-batch on, so they are
counted in every phase (the peak does not grow with the number of micro-batches).
"""

from __future__ import annotations

import re
from functools import lru_cache
from dataclasses import dataclass, field

from trainmem.inventory import Category, MemoryItem, dtype_bytes

__all__ = ["Phase", "phases"]

_LAYER = re.compile(r"\.(?:layers|h|layer)\.(\d+)\.")


@dataclass(frozen=True)
class Phase:
    name: str
    bytes: int
    parts: dict[str, int] = field(default_factory=dict)
    note: str = ""

    def to_dict(self) -> dict:
        return {"name": self.name, "bytes": self.bytes, "parts": dict(self.parts), "note": self.note}


@lru_cache(maxsize=1 << 16)
def _layer_of_prefix(prefix: str) -> int | None:
    m = _LAYER.search("." + prefix + ".")
    return int(m.group(1)) if m else None


def layer_of(name: str) -> int | None:
    """Block index in an item name (``model.layers.3.mlp.up_proj.out`` -> 3), else None."""
    return _layer_of_prefix(name.rpartition(".")[0])


def phases(items: list[MemoryItem], *, B: int, S: int, vocab: int, logits_dtype: str, loss_dtype: str,
           loss: str, grad_accum: int, recompute_bytes: dict[int, tuple[int, int]],
           optimizer_transient: tuple[int, str], residual_bytes: int,
           persistent: dict[str, int] | None = None, working: dict[str, int] | None = None) -> list[Phase]:
    """The live bytes of each phase. ``loss='none'``: this rank computes no loss (a pipeline
    stage before the last). ``persistent`` buffers live through the whole step (DDP buckets);
    ``working`` ones during forward and backward (FSDP all-gathers, ring buffers)."""
    persistent = {k: v for k, v in (persistent or {}).items() if v}
    working = {k: v for k, v in (working or {}).items() if v}
    by_cat: dict[Category, int] = {}
    act_layer: dict[int, int] = {}
    largest: dict[int, int] = {}
    grad_layer: dict[int, int] = {}
    head_act = 0
    for it in items:
        by_cat[it.category] = by_cat.get(it.category, 0) + it.bytes
        li = layer_of(it.name)
        if it.category is Category.ACTIVATION:
            if li is not None:
                act_layer[li] = act_layer.get(li, 0) + it.bytes
                largest[li] = max(largest.get(li, 0), it.bytes)
            elif it.name.startswith(("loss.", "lm_head.", "model.norm.", "transformer.ln_f.", "norm.", "cls.")):
                head_act += it.bytes
        elif it.category is Category.GRADIENT and li is not None:
            grad_layer[li] = grad_layer.get(li, 0) + it.bytes
    P = by_cat.get(Category.PARAMETER, 0)
    G = by_cat.get(Category.GRADIENT, 0)
    M = by_cat.get(Category.MASTER_WEIGHT, 0)
    O = by_cat.get(Category.OPTIMIZER_STATE, 0)
    A = by_cat.get(Category.ACTIVATION, 0)
    static = {"parameters": P, "master_weights": M, "optimizer_states": O}
    g_acc = G if grad_accum > 1 else 0
    grads_head = G - sum(grad_layer.values()) if grad_layer else G
    # the non-layer gradients produced before the blocks' backward are the head's; the
    # embedding's arrive last. Approximate "head" as everything outside blocks except the
    # embedding, which a tied head produces early anyway.
    BSV = B * S * vocab
    out: list[Phase] = []

    def add(name: str, parts: dict[str, int], note: str) -> None:
        bufs = {**persistent, **(working if name != "optimizer" else {})}
        full = {**static, **{k: v for k, v in parts.items() if v}, **bufs}
        out.append(Phase(name, sum(full.values()), full, note))

    if loss == "ce":
        lb = dtype_bytes(loss_dtype)
        logits = int(BSV * dtype_bytes(logits_dtype))
        upcast = int(BSV * lb) if loss_dtype != logits_dtype else 0
        add("forward", {"gradients": g_acc, "activations": A, "logits": logits + upcast},
            "end of forward: saved activations + logits (and their upcast copy) held by the output")
        add("backward_start", {"gradients": g_acc, "activations": A, "logits_grad": int(2 * BSV * lb)},
            f"loss backward: activations + grad of the log-softmax output and of the logits (2·B·S·V·{lb:g})")
    else:
        add("forward", {"gradients": g_acc, "activations": A},
            "end of forward" + (" (chunked loss)" if loss != "none" else ""))
    last = max(act_layer) if act_layer else None
    if last is not None:
        # the gradient of the block output, plus the gradient of the largest saved tensor
        # while that tensor is still held (e.g. dP next to P in eager attention)
        rec, rec_big = recompute_bytes.get(last, (0, 0))
        big = max(largest[last], rec_big)
        work = rec + residual_bytes + big
        g_now = G if grad_accum > 1 else grads_head
        add("backward", {"gradients": g_now, "activations": A - head_act, "recompute_and_work": work},
            "backward of the last block: head gradients, remaining activations, recomputed "
            "block activations, the output gradient and the gradient of its largest tensor")
    add("backward_end", {"gradients": G, "activations": A - head_act - sum(act_layer.values()),
                         "work": residual_bytes},
        "all gradients exist, block activations freed")
    tb, rule = optimizer_transient
    add("optimizer", {"gradients": G, "optimizer_temporaries": tb}, f"optimizer.step(): {rule}")
    return out


def recompute_per_layer(kept: list[MemoryItem], plain: list[MemoryItem]) -> dict[int, tuple[int, int]]:
    """(bytes, largest tensor) each checkpointed block re-materializes in its backward: what the
    block would keep without checkpointing minus what it keeps with it."""
    def per_layer(items):
        total: dict[int, int] = {}
        big: dict[int, int] = {}
        for it in items:
            li = layer_of(it.name)
            if li is not None:
                total[li] = total.get(li, 0) + it.bytes
                big[li] = max(big.get(li, 0), it.bytes)
        return total, big

    kt, _ = per_layer(kept)
    pt, pb = per_layer(plain)
    return {li: (pt[li] - kt.get(li, 0), pb[li]) for li in pt if pt[li] > kt.get(li, 0)}
