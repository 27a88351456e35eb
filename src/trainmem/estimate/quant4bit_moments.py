"""A 4-bit MLP's backward moments: where the dequantized weight is alive (QLoRA, bitsandbytes).

bitsandbytes' ``MatMul4Bit.backward`` (``autograd/_functions.py``) computes the input gradient as ``grad_output @
dequantize_4bit(B).to(grad_output.dtype).t()``: ``dequantize_4bit`` (``functional.py``) returns the weight in the dtype
it was quantized from (``QuantState.dtype``: the step's parameter dtype), ``.to`` copies it to the compute dtype when
the two differ (fp32 weights under ``amp-bf16`` or ``fp32`` precision with a bf16 ``bnb_4bit_compute_dtype``), and the
matmul makes the input gradient in the compute dtype. Each is a temporary of that one expression, freed before the
node returns (with double quantization the fp32 absmax is dequantized first, beside the weight's dequantization).
The function keeps its packed weight as an attribute (``ctx.tensors = (None, B)``), not a saved tensor, so in a
checkpointed block it unpacks nothing: the recomputation starts at the next node that does. ``Linear4bit.forward``
(``nn/modules.py``) casts its input to the compute dtype and its output back (``x.to(compute_dtype)``,
``.to(inp_dtype)``): under a cast the output gradient reaching ``MatMul4Bit`` is a compute-dtype copy made by the
output cast's ``ToCopyBackward0``, and its input gradient is cast back by the input cast's.

So the dequantized weight is alive at two moments of a frozen 4-bit gated MLP (transformers ``LlamaMLP``, no adapter
on it: peft's default q/v targets), not at the product's ``MulBackward0`` or the RMSNorms' nodes
(estimate/block_backward.py), where ``finetune.with_dequant_transient`` no longer adds it:

* the down projection's matmul (eager blocks): the residual stream's gradient (its ``grad_output``, or that and its
  compute-dtype copy), the weight and the product's gradient (B, S, F), beside every saved tensor but the block's
  output (a checkpointed block has not recomputed yet: that moment is below the up projection's);
* the up projection's matmul, after ``MulBackward0`` released the activation's and up's outputs: the residual
  gradient, the activation branch's gradient waiting for SiLU's node, up's output gradient (in the compute dtype),
  the weight and the input gradient (B, S, H), beside the gate output SiLU still holds (and a checkpointed block's
  recomputed set).

At each, the weight's part is the largest of the expression's three moments: the absmax and the weight as
dequantized, the weight as dequantized and its copy (a cast only), the copy and the matmul's output.

Tiny Llama (h64, F176, V128) bf16 QLoRA q/v, against a fake-tensor trace of the real bitsandbytes + peft model,
the backward phases: eager B1 S8 / S16 were 8,448 / 16,896 B over, full recompute B1 S8 / S16 7,424 / 14,848 B over
(the dequantized weight added at the product's moment), B1 / B2 S64 22,528 B over; all equal now. ``amp-bf16`` and
``fp32`` (fp32 weights, bf16 compute): full recompute B1 S8 / S16 25,344 / 5,632 B under (the fp32 dequantization
and its bf16 copy both alive), B1 / B2 S64 22,528 B over; all equal now (``tests/finetune/test_qlora_moments.py``).
Llama-2-7B S2048 full recompute: the block phase is the product's moment, 90,177,536 B (one 4096 x 11008 bf16
weight) lower than before (not traced at that size).

With adapters on every projection of the MLP (``--lora-targets all-linear``, ``qlora-*-all``), in one dtype, the
moment is the down projection's matmul, eager or checkpointed (:func:`_adapted_down_moments`); with a 16-bit MLP
(``--qlora-scope targeted``, adapters on the attention) no MLP or norm node holds a dequantized weight. Tiny Llama
bf16 B1/B2 x S16/S64 x eager/full recompute were up to 22,528 B (all-linear) and 8,192 B (targeted) over the trace;
equal now; under a cast (amp-bf16, fp32) the adapted down projection's input-gradient sum follows its matmul
(4,088-67,584 B over before, equal now) (``tests/finetune/test_qlora_adapted_moments.py``). Not modelled (the weight
is still added to every backward phase there): an adapted 4-bit MLP with adapter dropout, other MLPs; the attention
projections' own 4-bit matmul moments (below the MLP's at the sizes traced).
"""

from __future__ import annotations

import math

from trainmem.estimate.quant4bit import DEQUANTIZES_TO
from trainmem.inventory import Category, MemoryItem, dtype_bytes

__all__ = ["COMPUTES_IN", "four_bit_markers", "four_bit_mlp_moments", "four_bit_moments_modelled", "four_bit_weight"]

COMPUTES_IN = "it computes in "  # a 4-bit marker's note names the compute dtype after this (estimate/finetune.py)
_GATED = ("gate_proj", "up_proj", "down_proj")  # transformers ``LlamaMLP``: down(act(gate(x)) * up(x))


def four_bit_markers(block: list[MemoryItem], adapted: bool = False) -> dict[str, MemoryItem] | None:
    """The MLP's 4-bit input markers (estimate/finetune.py ``_linear4bit``), by projection, when every projection of
    a gated MLP is 4-bit and carries no adapter (``adapted``: or an adapter on each, :func:`_adapted`); else None."""
    marker = {i.name.split(".mlp.", 1)[1].split(".", 1)[0]: i for i in block if i.category is Category.ACTIVATION
              and not i.bytes and ".mlp." in i.name and i.name.endswith(".input") and i.shape
              and i.note.startswith("not saved: 4-bit") and COMPUTES_IN in i.note}
    # under a cast, bitsandbytes' weights only (their note names the dtype dequantize_4bit returns): torchao's
    # linear_nf4 dequantizes otherwise (estimate/finetune.py ``torchao_nf4_dequant_bytes``)
    cast = any(i.note.rpartition(COMPUTES_IN)[2] != i.dtype for i in marker.values())
    if any(".mlp." in i.name and ".lora_" in i.name for i in block) and not (adapted and _adapted(block)):
        return None
    bnb = all(DEQUANTIZES_TO in i.note for i in block if i.category is Category.PARAMETER and ".mlp." in i.name
              and i.name.endswith(".weight") and i.shape and ".lora_" not in i.name)
    return marker if set(_GATED) <= set(marker) and (bnb or not cast) else None


def _adapted(block: list[MemoryItem]) -> bool:
    """Adapters on every projection of the gated MLP, no adapter dropout (peft's default ``lora_dropout=0``:
    ``nn.Identity``): the layout whose down-projection moments :func:`_adapted_down_moments` reads."""
    lora = {p for p in _GATED if any(i.name.endswith(f".mlp.{p}.lora_A.default.weight") for i in block)}
    return lora == set(_GATED) and not any(".mlp." in i.name and ".lora_dropout." in i.name for i in block)


def four_bit_moments_modelled(block: list[MemoryItem], autocast: bool = False,
                              recomputed: list[MemoryItem] | None = None) -> bool:
    """Whether a block's 4-bit moments are read (:func:`four_bit_mlp_moments`; ``block``: its items,
    estimate/block_backward.py ``block_items``), so that its node moments hold no dequantized weight besides.
    ``autocast`` changes nothing: the casts around the 4-bit matmuls are modelled for any precision. A 16-bit MLP
    (``qlora_scope='targeted'`` with adapters on the attention only) runs no 4-bit matmul at its nodes or the
    norms': the dequantized attention weight is not alive there either. ``recomputed``: a checkpointed block's
    recomputed items, whose adapter dropout its saved ones do not show."""
    return four_bit_markers(block + list(recomputed or ()), adapted=True) is not None or not any(
        i.category is Category.PARAMETER and ".mlp." in i.name and "4-bit base" in i.note for i in block)


def four_bit_mlp_moments(block: list[MemoryItem], acts: list[MemoryItem], *, residual_bytes: int,
                         checkpointed: bool) -> list[dict[str, int]]:
    """The module docstring's two moments as node moments (estimate/peak.py ``inside``); [] for other layouts."""
    marker = four_bit_markers(block + acts, adapted=True)  # a checkpointed block's dropout shows in ``acts``
    if marker is None:
        return []
    weights = {p: next((i for i in block if i.category is Category.PARAMETER and i.name.endswith(f".mlp.{p}.weight")
                        and i.shape), None) for p in ("up_proj", "down_proj")}
    if weights["down_proj"] is not None and any(".mlp." in i.name and ".lora_" in i.name for i in block):
        return _adapted_down_moments(block, acts, weights["down_proj"], marker["down_proj"], residual_bytes)
    act, up = (next((i for i in acts if i.name.endswith(n)), None) for n in (".mlp.act_fn.out", ".mlp.up_proj.out"))
    if None in weights.values() or act is None or up is None:
        return []
    # the block's output, when kept (a 16-bit RMSNorm after it saves its own fp32 copy instead): freed by a later node
    out = sum(i.bytes for i in acts if i.name.endswith(".residual_mlp"))
    prod, x = marker["down_proj"], marker["up_proj"]
    c = prod.note.rpartition(COMPUTES_IN)[2]  # the compute dtype: the matmul's and the weight copy's
    cast = c != prod.dtype  # Linear4bit's input and output casts (autocast or fp32 activations)
    up_moment = {"block_gradients": 0, "freed_activations": out + act.bytes + up.bytes, "after_attention": 0,
                 # the activation branch's gradient (the product's dtype), up's output gradient (the compute dtype)
                 "work": residual_bytes + _bytes(prod) + _bytes(prod, c) +
                 _dequantized(block, weights["up_proj"], c, _bytes(x, c))}
    if checkpointed:
        return [up_moment]
    down_moment = {"block_gradients": 0, "freed_activations": out, "after_attention": 0,
                   # the output gradient's compute-dtype copy under a cast (the residual gradient's own dtype else)
                   "work": residual_bytes + (residual_bytes * dtype_bytes(c) // dtype_bytes(prod.dtype) if cast else 0)
                   + _dequantized(block, weights["down_proj"], c, _bytes(prod, c))}
    return [down_moment, up_moment]


def _adapted_down_moments(block: list[MemoryItem], acts: list[MemoryItem], weight: MemoryItem, prod: MemoryItem,
                          residual_bytes: int) -> list[dict[str, int]]:
    """An adapted down projection's 4-bit matmul (peft ``tuners/lora/bnb.py`` ``Linear4bit.forward``: ``result =
    base_layer(x).clone()``, then ``result + lora_B(lora_A(x)) * scaling``, ``x`` cast to the adapters' fp32 and the
    sum back to ``result``'s dtype outside autocast): the adapter branch's nodes are the later ones, so they ran first;
    ``lora_A``'s node made the adapters' weight gradients and the product's gradient (in the product's dtype) and
    released its saved input (the product itself where the adapters share its dtype) and ``lora_B``'s. Alive besides:
    the residual gradient, a second residual-sized gradient where peft converts (the base branch's, as
    recompute_stop.py ``_adapter_a_input_gradient`` finds for a 16-bit base), under a cast
    the output gradient's compute-dtype copy (``Linear4bit``'s ``.to(inp_dtype)`` node), and ``MatMul4Bit.backward``'s
    dequantized weight and input gradient (:func:`_dequantized`). Under a cast a second moment follows: the input
    gradient cast back to the product's dtype (``x.to(compute_dtype)``'s node) and summed with the adapter's
    (``InputBuffer::accumulate``, torch/csrc/autograd/input_buffer.cpp): three of the product's size. Eager and
    checkpointed alike: the adapter's nodes unpacked first, so a checkpointed block has recomputed."""
    out = sum(i.bytes for i in acts if i.name.endswith(".residual_mlp"))  # as four_bit_mlp_moments' ``out``
    # the adapters' saved tensors, and the product itself where lora_A saved it uncast (adapters in its dtype)
    own = [i for i in acts if ".mlp.down_proj.lora_" in i.name or i.name.endswith(".mlp.act_mul_up")]
    grads = sum(i.bytes for i in block if i.category is Category.GRADIENT and ".mlp.down_proj.lora_" in i.name)
    c = prod.note.rpartition(COMPUTES_IN)[2]
    cast = c != prod.dtype
    base = {"block_gradients": grads, "freed_activations": out + sum(i.bytes for i in own), "after_attention": 0}
    copy = residual_bytes * dtype_bytes(c) // dtype_bytes(prod.dtype) if cast else 0
    # peft's conversion (``requires_conversion``, fp32 adapters on a 16-bit product) leaves the base branch's gradient
    # apart; where the adapters' dtype is the product's (autocast, fp32 steps) the two branches share the residual's
    adapter = next(i for i in block if i.name.endswith(".mlp.down_proj.lora_A.default.weight"))
    grads_out = residual_bytes * (2 if adapter.dtype != prod.dtype else 1)
    matmul = {**base, "work": grads_out + _bytes(prod) + copy + _dequantized(block, weight, c, _bytes(prod, c))}
    return [matmul, {**base, "work": grads_out + 3 * _bytes(prod)}] if cast else [matmul]


def _dequantized(block: list[MemoryItem], weight: MemoryItem, compute: str, grad_in: int) -> int:
    """The most ``grad_output @ dequantize_4bit(B).to(compute)`` holds at once, besides ``grad_output``: the absmax
    (double quantization: dequantized to fp32 first) and the weight in its own dtype, that and its copy in
    ``compute`` when the two differ, the copy and the input gradient (``grad_in`` bytes)."""
    own = weight.note.rpartition(DEQUANTIZES_TO)[2] if DEQUANTIZES_TO in weight.note else compute
    absmax, as_compute = four_bit_weight(block, weight, compute)
    as_own = _bytes(weight, own)
    return max(absmax + as_own, as_own + as_compute if own != compute else 0, as_compute + grad_in)


def four_bit_weight(block: list[MemoryItem], weight: MemoryItem, dtype: str) -> tuple[int, int]:
    """(the fp32 absmax a nested (double-quantized) weight dequantizes first, one per quantization block, else 0;
    the weight dequantized to ``dtype``) in bytes: bitsandbytes ``functional.dequantize_4bit``."""
    nested = any(i.name == f"{weight.name}.absmax2" for i in block)
    blocks = next((i.shape[0] for i in block if i.name == f"{weight.name}.absmax"), 0) if nested else 0
    return blocks * 4, _bytes(weight, dtype)


def _bytes(item: MemoryItem, dtype: str | None = None) -> int:
    return int(math.prod(item.shape) * dtype_bytes(dtype or item.dtype))
