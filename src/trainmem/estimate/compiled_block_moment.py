"""The MLP moments of a compiled Llama block's backward without checkpointing (``--compile``, ``--recompute none``).

The partitioned backward graph (``torch/_functorch/partitioners.py`` ``min_cut_rematerialization_partition``)
gets the block's compiled saved set ``C`` (``rules_compiled.py``: norms' rsqrt and outputs, q, k, v, the SDPA
output and log-sum-exp, o_proj's output, gate, up and their product) and recomputes the cheap pointwise
values it did not save, here ``silu(gate)``, from the gate, on inductor's decompositions
(``torch/_inductor/decomposition.py`` ``select_decomp_table``; ``sigmoid`` as ``1 / (1 + exp(-x))`` and
``silu_backward`` in fp32, ``pw_cast_for_opmath`` in ``torch/_prims_common/wrappers.py``), each value freed
after its last use. After down_proj's backward (its weight gradient; the product freed):

* the recompute of ``silu(gate)``: down_proj's input gradient (the product's gradient, a·B·S·F) and two fp32
  B·S·F temporaries of sigmoid's chain at a time, beside the gate (16-bit: its fp32 copy, the 16-bit gate freed);
* in 16-bit, SiLU's backward: up_proj's weight and input gradients made (B·S·H), ``up`` freed, the gate's fp32
  copy and the three fp32 temporaries of ``silu_backward`` (the upcast gradient, ``sigmoid(gate)``, their
  product). In fp32 this moment is lower than the first (no upcast) and is not counted.

Beside both: the residual stream's gradient; the block's output (the next block's input, or the final norm's)
was freed by that reader's backward; and the zero-filled tangents of the graph's outputs the loss does not
read: without checkpointing transformers keeps the KV cache (``use_cache``, the config's default; checkpointing
turns it off), so each block's graph returns its roped k and its v, and their gradients, never made, are
materialized as zeros when the backward starts (``torch/autograd/function.py`` ``set_materialize_grads``,
default on, for the compiled ``autograd.Function``), B·Akv·S·hd each, freed once the attention's backward adds
its gradients to them. With one graph for the whole model every block's pair is made when that graph's
backward starts (:func:`cache_tangents`), and the logits' tangent too (``estimate/compiled_ce_loss.py``).

Checked against the trace (``trace/compiled.py``, the same partitioned graphs run op by op, no fusion): tiny
Llama (H 64, F 176, 4/2 heads, 4 blocks, V 32, untied), B 2 S 64, AdamW: estimate = trace, whole-model bf16
2,519,624 B (0.886 before) and fp32 4,677,704 B (0.952), per block bf16 2,474,568 B (0.950),
``tests/estimate/test_compiled_block_moment.py``. Inductor fuses these pointwise chains (as for the checkpointed
block, docs/compile.md: neither is a bound on the other). Only the Llama compiled set with SiLU in a pure
precision is read (``compiled_recompute._llama_compiled``); autocast, other activations: no moment.
"""

from __future__ import annotations

from trainmem.estimate.block_backward import block_items
from trainmem.inventory import Category, Inventory, MemoryItem, dtype_bytes
from trainmem.names import split_block

__all__ = ["uncheckpointed_moments", "cache_tangents", "block_grads"]

_FP32 = dtype_bytes("float32")
_CACHE = ("self_attn.k_rope", "self_attn.v_proj.out")  # what transformers' DynamicCache holds of a compiled block


def uncheckpointed_moments(kept: dict[str, MemoryItem], grads: dict[str, int], residual_bytes: int, *,
                           tangents: int) -> list[dict[str, int]]:
    """The MLP moments (dicts as ``compiled_checkpoint_moments`` returns) of a compiled Llama block whose saved
    set, by path inside the block, is ``kept``; ``grads``: down_proj's and up_proj's weight gradient bytes;
    ``tangents``: the zero-filled tangents alive (:func:`cache_tangents`)."""
    gate, up, prod = kept["mlp.gate_proj.out"], kept["mlp.up_proj.out"], kept["mlp.act_mul_up"]
    a = dtype_bytes(gate.dtype)
    out = kept["input_layernorm.out"]
    if residual_bytes != out.bytes // dtype_bytes(out.dtype) * a:
        return []  # autocast (a fp32 residual stream beside 16-bit linears): not read
    gate32 = gate.bytes // a * _FP32  # B·S·F in fp32
    # the gate's fp32 copy (16-bit: the 16-bit gate is freed; fp32: the gate is it)
    copy, copied = (gate32, gate.bytes) if a < _FP32 else (0, 0)
    block_out = kept["residual_mlp"].bytes if "residual_mlp" in kept else 0
    freed = prod.bytes + block_out + copied
    moments = [{"block_gradients": grads["down_proj"], "new_gradients": grads["down_proj"],
                "freed_activations": freed, "after_attention": 0,
                "work": residual_bytes + prod.bytes + 2 * gate32 + copy + tangents}]
    if a < _FP32:
        up_dx = residual_bytes  # up_proj's input gradient, B·S·H in the block's dtype
        moments.append({"block_gradients": grads["down_proj"] + grads["up_proj"],
                        "new_gradients": grads["down_proj"] + grads["up_proj"],
                        "freed_activations": freed + up.bytes, "after_attention": 0,
                        "work": residual_bytes + up_dx + copy + 3 * gate32 + tangents})
    return moments


def cache_tangents(items: "Inventory | list[MemoryItem]", blocks: "range | tuple[int, ...]") -> int:
    """The zero-filled tangents of the KV cache entries (each block's roped k and its v, kept without
    checkpointing: compiled names ``self_attn.k_rope``, ``self_attn.v_proj.out``) of ``blocks``."""
    return sum(i.bytes for b in blocks for i in block_items(items, b) if i.category is Category.ACTIVATION
               and _inner(i.name) in _CACHE)


def block_grads(block: list[MemoryItem]) -> dict[str, int]:
    """down_proj's and up_proj's weight gradient bytes among a block's items."""
    return {c: sum(i.bytes for i in block if i.category is Category.GRADIENT and f".mlp.{c}." in i.name)
            for c in ("down_proj", "up_proj")}


def _inner(name: str) -> str:
    parts = split_block(name)
    return parts[2] if parts else name
