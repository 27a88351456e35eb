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
was freed by that reader's backward; and two zero-filled k-shaped buffers (B·Akv·S·hd each) the backward graph
makes at its start and frees at the block's attention backward, read off the trace (their shape and lifetime
are the rotary slices' of k; with one graph for the whole model, every block's pair is made when the graph
starts, so block ``i``'s moment holds ``i + 1`` pairs).

Checked against the trace (``trace/compiled.py``, the same partitioned graphs run op by op, no fusion): tiny
Llama (H 64, F 176, 4/2 heads, 4 blocks, V 32, untied), B 2 S 64, AdamW: estimate = trace, whole-model bf16
2,519,624 B (0.886 before) and fp32 4,677,704 B (0.952), per block bf16 2,474,568 B (0.950),
``tests/estimate/test_compiled_block_moment.py``. Inductor fuses these pointwise chains (as for the checkpointed
block, docs/compile.md: neither is a bound on the other). Only the Llama compiled set with SiLU in a pure
precision is read (``compiled_recompute._llama_compiled``); autocast, other activations: no moment.
"""

from __future__ import annotations

from trainmem.inventory import Category, MemoryItem, dtype_bytes

__all__ = ["uncheckpointed_moments"]

_FP32 = dtype_bytes("float32")


def uncheckpointed_moments(kept: dict[str, MemoryItem], grads: dict[str, int], residual_bytes: int, *,
                           zero_pairs: int) -> list[dict[str, int]]:
    """The MLP moments (dicts as ``compiled_checkpoint_moments`` returns) of a compiled Llama block whose saved
    set, by path inside the block, is ``kept``; ``grads``: down_proj's and up_proj's weight gradient bytes;
    ``zero_pairs``: the blocks whose zero-filled k-shaped pair is alive (1 per block, the block index + 1 in one
    graph)."""
    gate, up, prod = kept["mlp.gate_proj.out"], kept["mlp.up_proj.out"], kept["mlp.act_mul_up"]
    a = dtype_bytes(gate.dtype)
    out = kept["input_layernorm.out"]
    if residual_bytes != out.bytes // dtype_bytes(out.dtype) * a:
        return []  # autocast (a fp32 residual stream beside 16-bit linears): not read
    gate32 = gate.bytes // a * _FP32  # B·S·F in fp32
    # the gate's fp32 copy (16-bit: the 16-bit gate is freed; fp32: the gate is it)
    copy, copied = (gate32, gate.bytes) if a < _FP32 else (0, 0)
    zeros = 2 * zero_pairs * kept["self_attn.k_rope"].bytes
    block_out = kept["residual_mlp"].bytes if "residual_mlp" in kept else 0
    freed = prod.bytes + block_out + copied
    moments = [{"block_gradients": grads["down_proj"], "new_gradients": grads["down_proj"],
                "freed_activations": freed, "after_attention": 0,
                "work": residual_bytes + prod.bytes + 2 * gate32 + copy + zeros}]
    if a < _FP32:
        up_dx = residual_bytes  # up_proj's input gradient, B·S·H in the block's dtype
        moments.append({"block_gradients": grads["down_proj"] + grads["up_proj"],
                        "new_gradients": grads["down_proj"] + grads["up_proj"],
                        "freed_activations": freed + up.bytes, "after_attention": 0,
                        "work": residual_bytes + up_dx + copy + 3 * gate32 + zeros})
    return moments


def block_grads(block: list[MemoryItem]) -> dict[str, int]:
    """down_proj's and up_proj's weight gradient bytes among a block's items."""
    return {c: sum(i.bytes for i in block if i.category is Category.GRADIENT and f".mlp.{c}." in i.name)
            for c in ("down_proj", "up_proj")}
