"""``--compile`` with ``--cp N``: refused, and why (what was found in torch 2.13, on CPU).

torchtitan compiles each block with context parallelism on (``torchtitan/models/llama3/infra/parallelize.py``
``apply_compile``; CP through ``torch.distributed.tensor.experimental.context_parallel``). trainmem's eager CP
is estimated (``estimate/parallel.py`` ``apply_cp``: the rank's S/cp; ``estimate/context_parallel.py``: the ring's
output copy and backward buffers, checked against torch's ring on fake tensors by tests/parallel/test_cp_*.py);
``trace`` runs no CP step (trace/parallel_fsdp.py ``check_fsdp_flags`` refuses ``--cp``), so there is no
traced eager CP step for a compiled one to stand beside. Two facts, pinned by tests/parallel/test_compiled_cp.py:

* torch's CP cannot run on CPU: ``_sdpa_handler`` and ``register_cp_sharding_rules``
  (``torch/distributed/tensor/experimental/_context_parallel/_attention.py``, ``_sharding_rules.py``) cover the
  CUDA flash, efficient and cuDNN kernels only, and SDPA on CPU is ``_scaled_dot_product_flash_attention_for_cpu``,
  which DTensor refuses (no sharding strategy), eager and compiled alike;
* on fake tensors, with CUDA's flash op standing in for SDPA (tests/parallel/cp_flash_standin.py; torch's own
  ``context_parallel``, ring, allgather rotation and head-tail load balancing unmodified), Dynamo compiles a
  transformers Llama block whole (``fullgraph=True``), and the partitioned block does not keep what eager CP
  keeps. The ring is desugared into local ops in the joint graph, the backward's K/V all-gather is the forward's
  (one node), and the partitioner keeps collective outputs (``torch/_functorch/partitioners.py``
  ``force_save_collectives``): at ``--recompute none`` the block saves the other ranks' K/V chunks, views of the
  all-gather output (whose storage, cp·2·B·(S/cp)·Akv·hd elements, then lives until backward), and a contiguous
  copy of the merged attention output as ``o_proj``'s input. Per block, beyond the one-device compiled set at
  S/cp (tiny Llama bf16, 4 heads, 4 K/V heads, hd 16, B=1, S=64; the values' own bytes): cp=2 +12,288 B,
  cp=4 +14,336 B, each ``B·(S/cp)·H·2 + 2·(cp-1)·B·(S/cp)·Akv·hd·2``. At ``--recompute full`` (torchtitan's
  long-context runs) the checkpointed block keeps its input as one device does, and one generator state per
  ring step's SDPA call (the CPU generator's 5,056 B each on fake CPU tensors); the all-gather is issued again
  when backward recomputes the block, a moment not modelled.

So a compiled CP block at ``--recompute none`` keeps about the whole sequence's K/V per layer, which the eager CP
rules do not model; it is refused until a CP trace exists to check the step against.
"""

from __future__ import annotations

__all__ = ["COMPILED_CP_NOT_TRACED", "compiled_cp_refusals"]

#: Why the estimate refuses a compiled block under context parallelism (the module docstring has the measurement).
COMPILED_CP_NOT_TRACED = (
    "torch 2.13's context_parallel has no CPU SDPA (aten._scaled_dot_product_flash_attention_for_cpu has no CP "
    "sharding rule), so no CP step is traced here; with CUDA's flash op standing in, a compiled block also keeps "
    "the all-gathered K/V of the other ranks, which the eager CP rules do not model (estimate/compiled_cp.py)")


def compiled_cp_refusals(ctx) -> list[tuple]:
    """``(field, value, bad, why)`` for :func:`trainmem.estimate.rules_compiled.check_compiled`."""
    return [("cp", ctx.shard.cp, ctx.shard.cp > 1, COMPILED_CP_NOT_TRACED)]
