"""A 4-bit MLP's backward moments: where the dequantized weight is alive (QLoRA, bitsandbytes).

bitsandbytes' ``MatMul4Bit.backward`` (``autograd/_functions.py``) computes the input gradient as ``grad_output @
dequantize_4bit(B).to(grad_output.dtype).t()``: the dequantized weight (numel in the compute dtype) is a temporary
of that one expression, alive only while the matmul makes its output, and freed before the node returns. The
function keeps its packed weight as an attribute (``ctx.tensors = (None, B)``), not a saved tensor, so in a
checkpointed block it unpacks nothing: the recomputation starts at the next node that does.

So the dequantized weight is alive at two moments of a frozen 4-bit gated MLP (transformers ``LlamaMLP``, no adapter
on it: peft's default q/v targets), not at the product's ``MulBackward0`` or the RMSNorms' nodes
(estimate/block_backward.py), where ``finetune.with_dequant_transient`` no longer adds it:

* the down projection's matmul (eager blocks): the residual stream's gradient (its ``grad_output``), the weight and
  the product's gradient (B, S, F), beside every saved tensor but the block's output (a checkpointed block has not
  recomputed yet: that moment is below the up projection's);
* the up projection's matmul, after ``MulBackward0`` released the activation's and up's outputs: the residual
  gradient, the activation branch's gradient waiting for SiLU's node, up's output gradient, the weight and the
  input gradient (B, S, H), beside the gate output SiLU still holds (and a checkpointed block's recomputed set).

Tiny Llama (h64, F176, V128) bf16 QLoRA q/v, against a fake-tensor trace of the real bitsandbytes + peft model,
the backward phases: eager B1 S8 / S16 were 8,448 / 16,896 B over, full recompute B1 S8 / S16 7,424 / 14,848 B over
(the dequantized weight added at the product's moment), B1 / B2 S64 22,528 B over; all equal now
(``tests/finetune/test_qlora_moments.py``). Llama-2-7B S2048 full recompute: the block phase is the product's moment,
90,177,536 B (one 4096 x 11008 bf16 weight) lower than before (not traced at that size). Not modelled (the weight is
still added to every backward phase there): autocast or fp32 steps (casts around the matmuls, the input cast's
``ToCopyBackward0``), adapters on the MLP (``--lora-targets`` with the MLP, ``qlora-*-all``), other MLPs.
"""

from __future__ import annotations

import math

from trainmem.inventory import Category, MemoryItem, dtype_bytes

__all__ = ["COMPUTES_IN", "four_bit_mlp_moments", "four_bit_moments_modelled"]

COMPUTES_IN = "it computes in "  # a 4-bit marker's note names the compute dtype after this (estimate/finetune.py)
_GATED = ("gate_proj", "up_proj", "down_proj")  # transformers ``LlamaMLP``: down(act(gate(x)) * up(x))


def _four_bit(block: list[MemoryItem]) -> dict[str, MemoryItem] | None:
    """The MLP's 4-bit input markers (estimate/finetune.py ``_linear4bit``), by projection, when every projection of
    a gated MLP is 4-bit and carries no adapter; else None."""
    marker = {i.name.split(".mlp.", 1)[1].split(".", 1)[0]: i for i in block if i.category is Category.ACTIVATION
              and not i.bytes and ".mlp." in i.name and i.name.endswith(".input") and i.shape
              and i.note.startswith("not saved: 4-bit")}
    adapted = any(".mlp." in i.name and ".lora_" in i.name for i in block)
    # no cast around the matmuls (the step computes in the 4-bit compute dtype: not under autocast, not fp32)
    same = all(i.note.rpartition(COMPUTES_IN)[2] == i.dtype for i in marker.values())
    return marker if set(_GATED) <= set(marker) and not adapted and same else None


def four_bit_moments_modelled(block: list[MemoryItem], autocast: bool) -> bool:
    """Whether a block's 4-bit moments are read (:func:`four_bit_mlp_moments`; ``block``: its items,
    estimate/block_backward.py ``block_items``), so that its node moments hold no dequantized weight besides."""
    return not autocast and _four_bit(block) is not None


def four_bit_mlp_moments(block: list[MemoryItem], acts: list[MemoryItem], *, residual_bytes: int,
                         checkpointed: bool) -> list[dict[str, int]]:
    """The module docstring's two moments as node moments (estimate/peak.py ``inside``); [] for other layouts, or
    where the step's tensors are cast around the 4-bit matmuls (autocast, fp32: :func:`_four_bit`)."""
    marker = _four_bit(block)
    if marker is None:
        return []
    weights = {p: next((i for i in block if i.category is Category.PARAMETER and i.name.endswith(f".mlp.{p}.weight")
                        and i.shape), None) for p in ("up_proj", "down_proj")}
    act, up = (next((i for i in acts if i.name.endswith(n)), None) for n in (".mlp.act_fn.out", ".mlp.up_proj.out"))
    if None in weights.values() or act is None or up is None:
        return []
    # the block's output, when kept (a 16-bit RMSNorm after it saves its own fp32 copy instead): freed by a later node
    out = sum(i.bytes for i in acts if i.name.endswith(".residual_mlp"))
    prod, x = marker["down_proj"], marker["up_proj"]
    b = dtype_bytes(prod.dtype)  # the compute dtype: the dequantized weight's and the matmul's
    up_moment = {"block_gradients": 0, "freed_activations": out + act.bytes + up.bytes, "after_attention": 0,
                 "work": residual_bytes + 2 * _bytes(prod) + int(math.prod(weights["up_proj"].shape) * b) + _bytes(x)}
    if checkpointed:
        return [up_moment]
    down_moment = {"block_gradients": 0, "freed_activations": out, "after_attention": 0,
                   "work": residual_bytes + _bytes(prod) + int(math.prod(weights["down_proj"].shape) * b)}
    return [down_moment, up_moment]


def _bytes(item: MemoryItem) -> int:
    return int(math.prod(item.shape) * dtype_bytes(item.dtype))
