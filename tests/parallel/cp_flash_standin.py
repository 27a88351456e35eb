"""SDPA as CUDA's flash dispatch, on fake tensors: torch's context parallelism run unmodified on CPU (a probe).

torch 2.13's CP dispatches SDPA to its ring only for the CUDA kernels
(``torch/distributed/tensor/experimental/_context_parallel/_attention.py``: ``_sdpa_handler``'s table and
``_sharding_rules.py`` ``register_cp_sharding_rules`` list flash, efficient and cuDNN); on CPU, SDPA is
``_scaled_dot_product_flash_attention_for_cpu``, which DTensor refuses. :func:`flash_sdpa` makes
``F.scaled_dot_product_attention`` call ``aten._scaled_dot_product_flash_attention``, the op CUDA's SDPA picks
for flash (``aten/src/ATen/native/transformers/attention.cpp`` ``scaled_dot_product_attention``, backend
``flash_attention``), so ``context_parallel`` wraps it and DTensor runs torch's own ring for it. The op has no CPU
kernel: this runs on fake tensors only (its meta kernel, ``torch/_meta_registrations.py``
``meta__scaled_dot_product_flash_attention``), which is how trainmem traces.
"""

from __future__ import annotations

import contextlib


@contextlib.contextmanager
def flash_sdpa():
    """``F.scaled_dot_product_attention`` replaced by the CUDA flash op for the duration (no mask, no GQA flag:
    transformers passes neither for a causal Llama with equal K/V heads after ``repeat_kv``)."""
    import torch
    import torch.nn.functional as F

    def scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                                     enable_gqa=False):
        if attn_mask is not None or enable_gqa:
            raise NotImplementedError("the flash stand-in takes no mask and no enable_gqa")
        return torch.ops.aten._scaled_dot_product_flash_attention(query, key, value, dropout_p, is_causal,
                                                                  scale=scale)[0]

    # context_parallel re-binds F by the replaced function's __name__ (_attention.py _distribute_function)
    original = F.scaled_dot_product_attention
    F.scaled_dot_product_attention = scaled_dot_product_attention
    try:
        yield
    finally:
        F.scaled_dot_product_attention = original
