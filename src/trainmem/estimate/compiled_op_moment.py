"""The backward moment of a block compiled around torchtitan's op-level checkpoint (``--compile --recompute op``).

torchtitan's op-level policy (``estimate/graph.py`` ``OpPolicy``) tags every op of the block: ``MUST_SAVE`` for
its 1st, 3rd, 5th... mm (and every addmm), ``PREFER_RECOMPUTE`` for the rest. Under compile the tags become node
metadata the partitioner obeys: ``torch/_functorch/partitioners.py`` ``must_recompute`` counts
``PREFER_RECOMPUTE`` with ``MUST_RECOMPUTE`` (recomputed whatever the min-cut would say) and
``solve_min_cut``'s ``should_ban_recomputation`` bans recomputing ``MUST_SAVE`` nodes. So the backward graph of
the block re-runs every forward value but the saved op outputs, and ``reordering_to_mimic_autograd_engine`` (same
file, run on every partitioned backward) brings each recomputed node in just before the first backward op that
needs it: the MLP's backward holds what it needs of the recompute, which depends on what was saved.

* o_proj's output recomputed from the attention (tiny Llama: o is the 4th mm): the residual sum, which the MLP's
  norm reads, needs the whole attention re-run first; the moments are the fully checkpointed block's
  (``estimate/compiled_recompute.py`` ``compiled_checkpoint_moments``, on the block's compiled saved set). A saved
  output that is the very tensor the compiled set holds (v, the gate, up) is held once; the saved q (and k)
  projection, read by the rotary's recompute alone, is freed (the compiled set holds the roped q).
* o_proj's output saved (Qwen2: q/k/v are addmm, so o is the 1st mm), or the SDPA output it is made from (CUDA's
  flash and memory-efficient kernels are on the policy's list: ``rules_compiled._op_attention``): the residual
  sum is recomputed from it and the block input; the attention's recompute waits for the attention's backward,
  so the input norm's recomputed values and the attention's compiled set are not held, the block input not freed.

* under autocast (amp-bf16) the bf16 weight copies of the mms the policy saved are not made before these moments
  (:func:`uncast_linears`), where ``--recompute full`` holds them from its recomputed forward on.

Where these moments exist they replace the block's generic working set (``peak.phases``: the whole recomputed
set at once), which the deferred case would over-count. Under FSDP2 the block's graph is the one-device one
(estimate/compiled_sharded.py). Checked against the trace (``trace --compile --compile-scope block --recompute
op``, the partitioned graphs run op by op): tiny Llama (H 64, F 176, 4/2 heads, V 256, untied), AdamW, B 2 S 64:
bf16 1,503,560 B, fp32 2,589,256 B (0.923 and 0.968 before); Qwen2 bf16 1,455,176 B, fp32 2,527,816 B; FSDP2
fp32 2,325,960 B (0.855 before); CUDA's kept SDPA output with the CPU kernel standing in, bf16 1,457,736 B
(tests/estimate/test_compiled_op_moment.py, test_compiled_op_cuda.py); amp-bf16 2,507,336 B (1.014 before;
test_compiled_op_amp.py). Known limitations: the unfused graphs'
moments (inductor fuses the pointwise chains: docs/compile.md); only the Llama block's compiled set is read
(``compiled_recompute._llama_compiled``); other blocks keep the generic working set.
"""

from __future__ import annotations

from trainmem.estimate.block_backward import block_items
from trainmem.inventory import Category, Inventory, MemoryItem, dtype_bytes
from trainmem.names import split_block
from trainmem.specs import ImplSpec

__all__ = ["recomputes_blocks", "op_block_freed", "uncast_linears"]

# a policy that saves o_proj's output, or the SDPA output it is made from, defers the attention's recompute
_SAVED_O = "self_attn.o_proj.out"
_DEFERS = (_SAVED_O, "self_attn.sdpa_out")
_INPUT_NORM = ("input_layernorm.rsqrt", "input_layernorm.out")
_FP32 = dtype_bytes("float32")


def recomputes_blocks(impl: ImplSpec) -> bool:
    """Whether a checkpointed block's backward moments run on its recomputed set (``peak.phases``'s
    ``recomputed``): ``--recompute full``, and op-level checkpointing inside a compiled block (eager op-level
    checkpointing keeps its saved outputs beside the recomputed ones: ``peak.recompute_per_layer``)."""
    return impl.recompute == "full" or (impl.compile and impl.recompute == "op") or (
        impl.recompute == "every-k" and not impl.compile)  # eager every-k: its checkpointed blocks as under full


def op_block_freed(items: "Inventory | list[MemoryItem]", last: int, kept: dict[str, MemoryItem], norm_held: int,
                   block_input: int) -> int:
    """What block ``last``'s MLP moments hold less than a fully checkpointed block's
    (``compiled_recompute.compiled_checkpoint_moments``, whose ``kept`` is the block's compiled set by path inside
    the block, ``norm_held`` what each recomputed RMSNorm holds beyond it, ``block_input`` the checkpoint's input
    it frees). 0 for a fully checkpointed block, which saves its input alone. Under op-level checkpointing:

    * the attention is recomputed (o_proj's output not saved): the saved activations the compiled set does not
      hold, read by the recompute alone (the q and k projections before the rotary), were freed;
    * o_proj's output saved (its mm is one the policy keeps, or q/k/v are addmm): the residual sum is recomputed
      from it and the block input, the attention is not yet: the input norm's recomputed values and the
      attention's compiled set beyond what the policy saved are not held, and the block input is not freed."""
    own = _own(items, last)
    uncast = uncast_linears(items, last, kept)  # amp-bf16: the kept mms' weight copies, not made yet
    if not any(n in own for n in _DEFERS):
        return (sum(i.bytes for n, i in own.items() if n not in kept) + sum(uncast.values())
                - _received_16bit(items, last, kept, block_input))
    # o_proj's output, recomputed from the saved SDPA output, is freed by the residual sum (counted there); the
    # attention's weight casts are among its compiled set (not held), the MLP's kept mms' too
    attention = sum(i.bytes for n, i in kept.items() if n.startswith("self_attn.") and n not in own and n != _SAVED_O)
    mlp_uncast = sum(b for n, b in uncast.items() if not n.startswith("self_attn."))
    return norm_held + sum(kept[n].bytes for n in _INPUT_NORM) + attention + mlp_uncast - block_input


def uncast_linears(items: "Inventory | list[MemoryItem]", last: int, kept: dict[str, MemoryItem]) -> dict[str, int]:
    """Under autocast (amp-bf16), the bytes of each bf16 weight copy (``*.weight_cast`` of the compiled set
    ``kept``) that block ``last``'s MLP moments do not hold under op-level checkpointing, by linear path: those of
    the linears whose mm output the policy saved (tiny Llama: q, v, gate). The cast (``_to_copy``, autocast's
    weight cast, aten/src/ATen/autocast_mode.cpp ``cached_cast``, a node of the traced graph) is a
    ``PREFER_RECOMPUTE`` node like every non-mm op (estimate/graph.py ``OpPolicy``); its saved mm reads it
    no more, so the recompute of the forward does not make it, and ``reordering_to_mimic_autograd_engine``
    (torch/_functorch/partitioners.py) brings it in only before its first backward reader, the linear's
    input-gradient mm, after these moments. A recomputed mm's cast is made by the recompute and held until that mm,
    as under --recompute full (compiled_recompute.py). Empty without autocast (no weight casts in ``kept``)."""
    return {n[:-len(".out")]: kept[c].bytes for n in _own(items, last)
            if n.endswith("_proj.out") and (c := n[:-len(".out")] + ".weight_cast") in kept}


def _own(items: "Inventory | list[MemoryItem]", last: int) -> dict[str, MemoryItem]:
    return {_inner(i.name): i for i in block_items(items, last) if i.category is Category.ACTIVATION}


def _received_16bit(items: "Inventory | list[MemoryItem]", last: int, kept: dict[str, MemoryItem],
                    block_input: int) -> int:
    """``block_input`` where block ``last``'s input is a pipeline stage's receive buffer in a 16-bit residual
    stream, else 0. A fully recomputed block frees its 16-bit input once the input norm's fp32 copy exists; a
    receive buffer is the schedule's (``_PipelineStageBase``'s per-micro-batch ``recv`` buffers, reused every
    step, counted as ``buffers.pp_recv_activations``), which the block's backward does not free. The stage's items
    then name nothing of the block before (estimate/parallel_pp.py ``without_recv_aliases``). A fp32 input is the
    norm's fp32 input itself, counted once either way."""
    if last == 0 or block_items(items, last - 1):
        return 0
    out = kept["input_layernorm.out"]
    return block_input if block_input * dtype_bytes(out.dtype) < _FP32 * out.bytes else 0


def _inner(name: str) -> str:
    parts = split_block(name)
    return parts[2] if parts else name
