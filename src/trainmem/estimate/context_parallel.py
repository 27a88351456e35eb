"""What torch's context parallelism (``--cp N --cp-style ring``) changes in a rank's saved set.

Measured on fake tensors with torch's own ``context_parallel`` (ring, all-gather rotation, head-tail load
balancing; ``torch/distributed/tensor/experimental/_context_parallel/_attention.py``) and CUDA's flash op
standing in for SDPA (tests/parallel/cp_flash_standin.py, tests/parallel/test_cp_saved_set.py). Each rank keeps
one device's saved set at S/cp (the flash op's q, k, v, output and log-sum-exp are the rank's local chunks: the
ring's rotated K/V and partial outputs live only inside the attention call), and one more tensor per attention
layer on every rank but the last:

* ``_templated_ring_attention`` merges each ring step's output with ``_SDPAMerger``; a step where the rank's
  second query chunk alone attends (load balancing, ``i > rank``: every rank but the last has one) goes through
  ``_partial_update``, whose ``torch.cat`` returns a (B, A, S/cp, hd)-contiguous merged output, where the flash
  kernel's own output is laid out (B, S, A, hd). transformers' ``sdpa_attention_forward`` then copies it in
  ``attn_output.transpose(1, 2).contiguous()``, and ``o_proj`` keeps that copy: B·(S/cp)·A·hd elements.
  The last rank only adds in place of a whole step (``i <= rank``), the merged output keeps the kernel's layout
  and the transpose is a view, as on one device: it keeps B·(S/cp)·A·hd fewer elements per layer than the
  ranks modelled here (the estimate reports the worst rank).

Known limitation: the flash op's output layout is its meta kernel's (``torch/_meta_registrations.py``
``meta__scaled_dot_product_flash_attention``: ``empty_like(query)``), not a CUDA run's; for a transformers
Llama the query reaching SDPA is laid out (B, S, A, hd), as the CUDA kernel's output is, but this is unverified
on a GPU.
"""

from __future__ import annotations

__all__ = ["ring_merged_copy"]


def ring_merged_copy(ctx) -> bool:
    """Whether ``o_proj``'s input is a copy of the merged attention output (module docstring): torch's
    load-balanced ring (``--cp-style ring``) on the worst rank."""
    return ctx.shard.cp > 1 and ctx.shard.cp_style == "ring"
