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


@contextlib.contextmanager
def cp_world(cp: int, rank: int = 0):
    """Rank ``rank`` of ``cp`` in torch's fake process group and a 1-D CPU mesh over it (as
    ``trainmem.trace.parallel_fsdp.fake_world``, which is rank 0 only: the ring's work differs by rank)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from trainmem.trace.parallel_fsdp import forget_meshes_of_other_worlds

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=max(cp, 2))
    forget_meshes_of_other_worlds()
    try:
        yield init_device_mesh("cpu", (max(cp, 2),))
    finally:
        dist.destroy_process_group()
        forget_meshes_of_other_worlds()


def cp_saved(config: dict, cp: int, seq: int, rank: int = 0) -> list:
    """What autograd keeps (``trainmem.trace.saved.saved_tensors``) for one forward of the transformers model of
    ``config`` (bf16, fake tensors, B=1) on rank ``rank`` of torch's own ``context_parallel`` over the ids with
    :func:`flash_sdpa` standing in for SDPA; ``cp=1``: one device with the same op at ``seq``."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed.tensor.experimental import context_parallel
    from transformers import AutoConfig, AutoModelForCausalLM

    from trainmem.trace.hf_masks import masks_as_on_real_tensors
    from trainmem.trace.saved import saved_tensors

    cfg = AutoConfig.for_model(**config, attn_implementation="sdpa", torch_dtype=torch.bfloat16)
    old = torch.get_default_dtype()
    with cp_world(cp, rank) as mesh, FakeTensorMode(), masks_as_on_real_tensors(), flash_sdpa():
        torch.set_default_dtype(torch.bfloat16)
        try:
            model = AutoModelForCausalLM.from_config(cfg).train()
            ids = torch.randint(0, cfg.vocab_size, (1, seq))  # cut to the rank's chunks in place
            with context_parallel(mesh, buffers=[ids], buffer_seq_dims=[1]) if cp > 1 else contextlib.nullcontext():
                saved, loss = saved_tensors(model, lambda: model(input_ids=ids, labels=ids, use_cache=False).loss)
                loss.backward()
        finally:
            torch.set_default_dtype(old)
    return saved
