"""The backward of a Llama block compiled around torchtitan's op-level checkpoint with torchao's Float8 ``rowwise``
(``--float8 rowwise --compile --compile-scope block --recompute op``), bf16, as a timeline of allocations.

What the block keeps (estimate/compiled_float8_op.py, "Rowwise"): its input, the policy's kept mm outputs its backward
reads (q, v, the gate: the 1st, 3rd and 5th mm, as without Float8) and the q/k/v and gate/up input casts' per-row
inverse scales. Its partitioned backward (``torch/_functorch/partitioners.py`` ``min_cut_rematerialization_partition``:
the region's untagged nodes are recomputed, ``must_recompute``; the MUST_SAVE ones are saved) runs, read off the trace
(``trace/compiled.py``: the partitioned graphs op by op on fake tensors), as the checkpointed block's
(compiled_float8_rowwise_recompute.py) but for what the policy kept:

* down_proj's input gradient first (its grad_output cast per row, abs and fp32 copy held for the per-column cast);
* the input norm again (not with the SDPA output kept, CUDA's flash and memory-efficient kernels: the attention's
  recompute then waits for its backward, as compiled_op_moment.py's, and o_proj reads the saved output), q/k/v's input
  cast per row, its scale freed once the scaled product is made (the mm reads the
  saved inverse scale, freed after k's mm, the last recomputed reader); k's forward alone (q and v are kept): its
  weight cast per output, the ``abs`` and fp32 copy held for k's input gradient; the rotary embedding of the saved q
  and the recomputed k (each projection freed by ``rotate_half``), SDPA's output and log-sum-exp;
* o_proj as in the checkpointed block, the residual sum (the saved block input and o freed), the second norm, the
  gate/up input's cast (its scale freed as q/k/v's); SiLU on the saved gate (freed by its fp32 copy); up's forward
  alone (the gate's mm is kept); the product;
* the MLP's backward as without checkpointing (compiled_float8_rowwise.py): up's input gradient casts its weight from
  the held copies, gate's casts its weight afresh (its forward was not re-run).

:func:`rowwise_op_moments` returns a moment at every allocation of that replay (the amax and power-of-2 scale chains'
transients of a few bytes per row left out, as in compiled_float8_rowwise.py), beside the residual gradient: every
value of the recomputed set and of the block's own saved set counts as freed, and what is alive is the replay's own
(the saved tensors it reads listed as alive from the start). Checked: tests/estimate/test_float8_compiled_rowwise_op.py
(estimate == trace to the byte, one device and FSDP2).

Known limitations: bf16 only (``check_compiled``); the CUDA kernels' kept SDPA output is checked with the CPU kernel
standing in on the policy's list (tests/estimate/test_compiled_op_cuda.py ``cpu_sdpa_saved``); the attention's and the input norm's backward
after the MLP's are not replayed (k's and o's held weight copies are freed there); inductor fuses the casts and the
output scaling (no fp32 copies on a GPU): this is the unfused graph's moment, as the other compiled moments are.
"""

from __future__ import annotations

from dataclasses import astuple

from trainmem.estimate.compiled_float8_rowwise_recompute import Forward, block_dims
from trainmem.inventory import MemoryItem

__all__ = ["is_rowwise_op_block", "rowwise_op_moments"]

# the block's own saved set under the op policy (by path inside the block), beside its input
_OWN = ("self_attn.q_proj.out", "self_attn.v_proj.out", "mlp.gate_proj.out", "self_attn.q_proj.input_scale_inv",
        "mlp.gate_proj.input_scale_inv")


def is_rowwise_op_block(own: dict[str, MemoryItem]) -> bool:
    """Whether ``own`` (a block's own saved set by path inside the block) is the rowwise op-policy set (module
    docstring): the kept outputs and the two per-row inverse scales, no scalar of tensorwise's."""
    return set(_OWN) <= set(own) and not any(n.endswith(("amax", "weight_scale_inv")) for n in own)


def rowwise_op_moments(own: dict[str, MemoryItem], kept: dict[str, MemoryItem],
                       residual_bytes: int) -> list[dict[str, int]]:
    """A moment at every allocation of the replayed backward (module docstring) of a block whose own saved set is
    ``own`` (:func:`is_rowwise_op_block`) and whose compiled saved set without checkpointing is ``kept`` (both by path
    inside the block; the bf16 rowwise Llama set, compiled_float8_rowwise.py ``is_rowwise_block``), beside the residual
    gradient (``residual_bytes``)."""
    d = block_dims(kept, residual_bytes)
    if d is None or not is_rowwise_op_block(own):
        return []
    a, th, tf, hidden, ffn, tokens, fh, width, kv = astuple(d)
    # the recomputed set, the block's own saved tensors it lacks and its input (as "x_in") count as freed; the saved
    # tensors the replay reads are alive from the start and freed where their last reader frees them
    deferred = "self_attn.sdpa_out" in own  # the SDPA output kept: the attention's recompute waits for its backward
    extra = sum(i.bytes for n, i in own.items() if n not in kept)
    t = Forward(residual_bytes, sum(i.bytes for i in kept.values()) + extra + th * a)
    saved = {"x_in": th * a, "q": "self_attn.q_proj.out", "v": "self_attn.v_proj.out", "gate": "mlp.gate_proj.out",
             "x_qkv.inv": "self_attn.q_proj.input_scale_inv", "x_mlp.inv": "mlp.gate_proj.input_scale_inv",
             **({"sdpa_out": "self_attn.sdpa_out", "lse": "self_attn.lse"} if deferred else {})}
    t.live.update({n: v if isinstance(v, int) else own[v].bytes for n, v in saved.items()})
    t.input_gradient("down", th, tokens, ffn, fh, a=a)
    if not deferred:  # the attention recomputed: k alone (q and v kept), its input cast's inverse scale saved
        t.attention(d, kept, ("k",))
    # o_proj, the residual sum (o freed; the block input too unless the attention's recompute waits for it), the
    # second norm, the gate/up input's cast (its inverse scale saved)
    t.o_proj_and_norm(d, inverse_saved=True, free_input=not deferred)
    # SiLU on the saved gate (freed by its fp32 copy), up alone, the product, the MLP's backward (gate's weight cast
    # afresh: its forward was not re-run)
    t.mlp(th, tf, tokens, hidden, a=a, gate_held=False)
    return t.moments
