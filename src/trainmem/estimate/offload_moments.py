"""Activation offload's block backward moments (``--offload activations``, no recompute): an RMSNorm's, the gated MLP's.

Without offload a Llama-style RMSNorm's last backward node (``PowBackward0``) is a block moment
(estimate/block_backward.py): five fp32 temporaries of the norm's input size beside its saved fp32
input copy ``x_fp32``. Under torchtune's ``OffloadActivations`` (torchtune/training/_activation_offloading.py,
``unpack_tensor_with_streams``) that copy is on the host, and two device copies of it are alive there:

* the norm's fp32 input is saved twice, by ``pow(2)`` and by ``x * rsqrt``; every pack is its own host
  copy (``pack_tensor``), so each of the two nodes brings back its own device tensor;
* a brought-back tensor stays in ``bwd_tensor_stash`` until the next node that brings one back has run
  (the hook registered on that node pops the previous node's ids). ``MulBackward0`` (``x * rsqrt``)
  brought back the first copy; ``RsqrtBackward0`` unpacks only ``rsqrt``, kept on the device under
  ``min_offload_size`` (not a new node for the stash: torchtune's unpack hook returns kept tensors
  before its node bookkeeping), and ``MeanBackward1`` saves nothing; so while ``PowBackward0`` runs, its own
  copy and the mul's are both on the device. When ``rsqrt`` itself was copied out (``B·S·4 >= 1024``),
  its node is the previous one instead: the mul's copy is gone and the rsqrt's copy is alive.

The phases' block working set under offload (estimate/activation_offload.py ``in_flight``, the MLP
product's bound) does not reach this moment when the norm's fp32 input is the block's widest tensor
next to its gradients: tiny Llama (h64, 2 layers, V256, B1 S64, bf16) traced 945,224 B at block 0's
input norm against 920,256 B estimated (the optimizer phase) before this moment was modelled.
"""

from __future__ import annotations

from trainmem.estimate.block_backward import FP32_NORM_TRANSIENTS, block_items, llama_norm_indices
from trainmem.estimate.block_moment_phases import gradient_parts, loss_scalar_bytes, with_block_moments
from trainmem.estimate.phase import Phase
from trainmem.inventory import Category, Inventory
from trainmem.names import split_block

__all__ = ["with_offload_moments"]


def _child(name: str) -> str:
    parts = split_block(name)
    return parts[2].split(".", 1)[0] if parts else ""


def _norm_moments(acts: Inventory, device: Inventory, li: int, residual_bytes: int) -> list[dict[str, int]]:
    """Block ``li``'s RMSNorms' ``PowBackward0`` moments: the block's gradients made by then, the device bytes
    its nodes freed by then, the node's work and the brought-back copies (the module docstring). ``acts``: the
    saved set before the split (every tensor's bytes); ``device``: what stays on the device (offloaded items
    with zero bytes)."""
    saved = [i for i in block_items(acts, li) if i.category is Category.ACTIVATION and i.bytes]
    on_device = {i.name: i.bytes for i in block_items(device, li) if i.category is Category.ACTIVATION}
    grads = [i for i in block_items(device, li) if i.category is Category.GRADIENT]
    out = []
    for at in llama_norm_indices(saved):
        x, rsqrt = saved[at], saved[at + 1]
        children = {_child(i.name) for i in saved[at:]}
        if on_device.get(x.name, 0):  # under min_offload_size: held on the device, nothing brought back
            copies = 0
        else:  # pow's own copy, and the previous node's: the mul's copy of x, or the rsqrt's when it went out
            copies = x.bytes + (x.bytes if on_device.get(rsqrt.name, 0) else rsqrt.bytes)
        out.append({"block_gradients": sum(i.bytes for i in grads if _child(i.name) in children),
                    "freed": sum(on_device.get(i.name, 0) for i in saved[at + 1:]),
                    "work": residual_bytes + FP32_NORM_TRANSIENTS * x.bytes, "copies": copies,
                    "where": "an RMSNorm's PowBackward0"})
    return out


_GATED = ("gate_proj.out", "act_fn.out", "up_proj.out", "act_mul_up")  # a Llama MLP's saved set (hf rules)


def _gated_mlp_moment(acts: Inventory, device: Inventory, li: int, residual_bytes: int) -> list[dict[str, int]]:
    """Block ``li``'s gated MLP product's ``MulBackward0`` (``act_fn(gate) * up``): the down projection's
    gradients exist; alive beside the residual gradient are the product's gradient (the down projection's
    input gradient) and the node's two output gradients (``3·F``-sized: block_backward.py ``_gated_mlp``), the
    node's own two brought-back copies (the activation's output and the up projection's) and the previous
    node's (``MmBackward0``: the product and ``weight.t()``, a view torchtune copies as it is no Parameter).
    Only where every one of the four was copied out and the block has no autocast weight copies."""
    saved = [i for i in block_items(acts, li) if i.category is Category.ACTIVATION and i.bytes]
    on_device = {i.name: i.bytes for i in block_items(device, li) if i.category is Category.ACTIVATION}
    mlp = {i.name.split(".mlp.", 1)[1]: i for i in saved if ".mlp." in i.name}
    weight = next((i for i in block_items(device, li) if i.category is Category.PARAMETER
                   and i.name.endswith(".mlp.down_proj.weight")), None)
    if set(mlp) != set(_GATED) or weight is None or any(on_device.get(mlp[n].name, 0) for n in _GATED):
        return []
    prod = mlp["act_mul_up"]
    at = saved.index(prod)
    return [{"block_gradients": sum(i.bytes for i in block_items(device, li) if i.category is Category.GRADIENT
                                    and ".mlp.down_proj." in i.name),
             "freed": sum(on_device.get(i.name, 0) for i in saved[at:]),
             "work": residual_bytes + 3 * prod.bytes,
             "copies": prod.bytes + weight.bytes + mlp["act_fn.out"].bytes + mlp["up_proj.out"].bytes,
             "where": "the gated MLP product's MulBackward0"}]


def with_offload_moments(phases: list[Phase], acts: Inventory, device: Inventory, *, residual_bytes: int,
                         loss: str, loss_dtype: str, grad_accum: int) -> list[Phase]:
    """``phases`` whose block backward phases are the larger of their working set and the block's RMSNorm and
    gated MLP moments under offload (estimate/block_moment_phases.py). Under the cross-entropy the loss and its
    seed gradient (``ones_like``) are alive through backward. Not modelled: the rotary ``cos``/``sin`` a first
    block's attention backward frees, when they are under ``min_offload_size`` and so on the device
    (``S·head_dim·2 < 1024`` in 16-bit)."""
    G = sum(i.bytes for i in device if i.category is Category.GRADIENT)
    scalars = loss_scalar_bytes(loss, loss_dtype)

    def moments(li: int, before: int, p: Phase):
        base = {k: v for k, v in p.parts.items() if k not in ("gradients", "recompute_and_work", "offload_in_flight")}
        for m in (*_norm_moments(acts, device, li, residual_bytes),
                  *_gated_mlp_moment(acts, device, li, residual_bytes)):
            yield ({**base, **gradient_parts(before, m["block_gradients"], G),
                    "activations": p.parts.get("activations", 0) - m["freed"],
                    "node_work": m["work"] + scalars, "offload_in_flight": m["copies"]}, m["where"])

    return with_block_moments(phases, device, moments, grad_accum=grad_accum,
                              source="and the tensors brought back: estimate/offload_moments.py")
