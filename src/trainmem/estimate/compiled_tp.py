"""``--compile --compile-scope block --tp N [--sp]``: compiled blocks under DTensor tensor parallelism.

torchtitan compiles each block after cutting it (``torchtitan/models/llama3/infra/parallelize.py``:
``apply_tp``, then ``apply_ac``, then ``apply_compile``). Dynamo traces the block's DTensor code and
AOTAutograd desugars it (``torch/_functorch/_aot_autograd/subclass_utils.py``: a DTensor input enters
the joint graph as its local tensor), so the partitioned graph holds the rank's local ops and the
collectives DTensor issues, as functional collectives (``_c10d_functional.all_reduce`` /
``all_gather_into_tensor`` / ``reduce_scatter_tensor``, each followed by ``wait_tensor``). The partitioner
may not recompute those: ``force_save_collectives`` tags every ``_c10d_functional`` node MUST_SAVE
unless it sits in a checkpointed region (``torch/_functorch/partitioners.py``, and
``should_ban_recomputation``: collectives are always banned from recompute).

What the compiled block keeps, read off the partitioned regions of a tiny Llama traced as rank 0 of 2
(``tests/trace/test_trace_compile_tp.py``) and checked against a real 2-rank gloo step
(``measure_dist/worker.py``, strategy ``tp``, ``compile="partition"``):

* without ``--sp`` (fake tensors only, refused): the one-device compiled set (``rules_compiled._compiled_block``)
  at the rank's shapes (heads, K/V heads and FFN width ÷ tp; tiny Llama fp32: 809,476 B, as one device at those
  shapes). ``o_proj``'s kept output is the all-reduce's output (``wait_tensor``), the same B·S·H. A real-tensor
  run of that step fails in torch 2.13 (the embedding's ``Redistribute.backward`` gets a plain tensor back from
  the compiled first block, with trainmem's backend and ``aot_eager`` alike), so it is not modelled;
* with ``--sp``: the block input, both norms' ``rsqrt`` and ``o_proj``'s reduce-scattered output are on
  the rank's S/tp tokens; each norm's local output is not kept, its all-gathered B·S·H copy is (the
  collective's output: the column-parallel linears' input); q, k, v, the SDPA outputs and the MLP's
  gate, up and product are full S at the rank's heads and width. The eager embedding (reduce-scattered
  to S/tp) and the head's all-gathered input are as in eager SP (``rules_hf``).

So the rules are ``rules_compiled``'s per-block rules with the rank-local model and ``Ctx.sp_scatter`` /
``Ctx.sp_gather`` at those four places (no-ops without SP). Per block, the saved bytes are
``one_device(B, S, H, A/tp, Akv/tp, F/tp)`` without SP, and with SP that less
``(tp-1)/tp · (2·B·S·H + 2·4·B·S)·bytes`` for the input and ``o_proj`` output on S/tp and the fp32 rsqrt
pair (the gathered norm outputs are the one-device size).

Refused (:func:`compiled_tp_refusals`, and the layouts by estimate/compiled_3d.py ``check_compiled_tp_layout``,
one line each), as not traced:
  - TP without sequence parallelism (above);
  - ``--recompute full`` (and op): torch 2.13 cannot run a checkpointed compiled DTensor block with SDPA, on a real
    gloo group as on the fake one (:data:`CHECKPOINTED_TP_BLOCK_FAILS`);
  - whole-model compile and ``block-loss`` (the loss under ``loss_parallel`` is eager in torchtitan);
  - context and expert parallelism, DDP/ZeRO and HSDP beside TP, fine-tuning, Float8, autocast, and
    families other than the plain Llama block (no fused, sandwich or post norms, q/k norms, MoE, eager attention).

TP then FSDP2 full sharding (``--dp D --fsdp full``, torchtitan's 2-D layout: ``apply_tp``, ``apply_compile``,
``apply_fsdp`` on the ``dp_shard`` sub-mesh) is the composition: FSDP2's hooks are dynamo-disabled
(estimate/compiled_sharded.py), so the region's inputs are the TP-local weights FSDP2 all-gathered and each
block keeps the compiled TP set above; the states and buffers are FSDP2's over the TP-local shards
(estimate/parallel.py, as eager). Under ``fsdp-bf16`` the block reads bf16 weights: pure bf16's set. Traced
and checked against a real 4-rank gloo step in tests/trace/test_trace_compile_2d.py (saved set and ledgers
to the byte; peak estimate/trace 1.033 fp32, 1.091 bf16, 1.074 fsdp-bf16). With pipeline stages too
(torchtitan's 3-D layout): estimate/compiled_3d.py.
"""

from __future__ import annotations

from trainmem.estimate.attention import resolve_kernel
from trainmem.families import family_of

__all__ = ["CHECKPOINTED_TP_BLOCK_FAILS", "compiled_tp_refusals"]

#: Why the estimate refuses a checkpointed compiled TP block (trace/parallel_tp.py says it shorter). The region's
#: backward returns DTensor gradients, so its forward saves the mesh, an opaque object (AOTAutograd orders saved
#: values tensors, opaque objects, SymInts: ``partitioners.py`` ``_extract_fwd_bwd_modules``). Checkpointing makes
#: the partitioner recompute SDPA, an rng-tagged op, whose rng state ``functionalize_rng_ops`` inserts just before
#: the SymInts, after the mesh; ``_AutogradSavedState.save_from_forward`` (``_aot_autograd/runtime_wrappers.py``)
#: counts the tensor slice from the end and reads the mesh as a saved tensor. Measured
#: (tests/parallel/test_compiled_tp_checkpoint_real.py): a real 2-rank gloo step in torchtitan's order
#: (checkpoint_wrapper, then torch.compile) fails with aot_eager and trainmem's backend (inductor too, by hand);
#: it runs without checkpointing, and checkpointed under eager attention (no rng op to recompute).
#: ``--recompute op`` fails the same on CPU, where torchtitan's policy recomputes the CPU SDPA kernel; with that
#: kernel on its save list, as CUDA's are, the real step runs (a control of the same test), but the op-level TP
#: set is not modelled: refused too.
CHECKPOINTED_TP_BLOCK_FAILS = (
    "torch 2.13 fails a checkpointed compiled DTensor block with SDPA, on a real gloo group too: "
    "torch/_functorch/partitioners.py functionalize_rng_ops puts the recomputed SDPA's rng state after the saved "
    "DeviceMesh, and _AutogradSavedState.save_from_forward (_aot_autograd/runtime_wrappers.py) reads the mesh as a "
    "saved tensor")


def compiled_tp_refusals(ctx) -> list[tuple]:
    """``(field, value, bad, why)`` for :func:`trainmem.estimate.rules_compiled.check_compiled`: what a
    compiled block under TP was not checked with (none when ``tp == 1``)."""
    sh, impl, m = ctx.shard, ctx.impl, ctx.model
    if sh.tp == 1:
        return []
    rules = family_of(m).rules
    plain_block = not (rules.fused_qkv or rules.fused_gate_up or rules.sandwich_norms or rules.post_norms
                       or m.qk_norm or m.is_moe or rules.forward != "llama")
    return [
        ("parallel", f"tp={sh.tp} cp={sh.cp} ep={sh.ep}", sh.cp > 1 or sh.ep > 1,
         "compiled blocks under TP are checked with tensor (and sequence) parallelism alone"),
        ("sp", sh.sp, not sh.sp, "compiled blocks under TP are modelled with sequence parallelism (torchtitan's "
         "plan): torch 2.13 fails a real compiled TP step without it (trace/parallel_tp.py)"),
        ("compile_scope", impl.compile_scope, impl.compile_scope != "block",
         "compiled rules under TP cover --compile-scope block (torchtitan's apply_compile after apply_tp)"),
        ("recompute", impl.recompute, impl.recompute != "none",
         f"compiled blocks under TP are modelled at --recompute none: {CHECKPOINTED_TP_BLOCK_FAILS}"),
        # fsdp-bf16 (TP + FSDP2's MixedPrecisionPolicy): bf16 gathered weights, pure bf16's saved set (traced)
        ("precision", ctx.step.precision, ctx.step.recipe not in ("fp32", "bf16", "fsdp-bf16"),
         "compiled rules under TP cover pure fp32 and bf16, and fsdp-bf16 under FSDP2"),
        ("model", m.family, not plain_block or resolve_kernel(ctx) not in ("flash", "efficient"),
         "compiled rules under TP cover the plain Llama block (no fused projections, extra or q/k norms, MoE) with "
         "a fused attention kernel"),
        ("float8", impl.float8, impl.float8 != "none", "compiled Float8 under TP is not traced"),
    ]
