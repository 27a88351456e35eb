"""Activation recompute in a traced or measured Hugging Face step (``ImplSpec.recompute``):
``full`` and ``every-k`` use Hugging Face gradient checkpointing (non-reentrant
``torch.utils.checkpoint``) on every / every k-th decoder layer; ``selective`` checkpoints the
attention core (the ``attention_interface`` call: scores, softmax, dropout and the weighted sum),
not the projections; ``op`` checkpoints every decoder layer with
``create_selective_checkpoint_contexts`` and torchtitan's op policy (:func:`op_sac_context`)."""

from __future__ import annotations

import contextlib
import sys
from typing import Any

from trainmem.errors import UnsupportedError
from trainmem.specs import ImplSpec

__all__ = ["selective_recompute", "op_sac_context", "enable_recompute", "place_every_k_trace"]


@contextlib.contextmanager
def selective_recompute(model, attention: str):
    """Checkpoint each attention core call (``selective``: see the module docstring)."""
    import torch.utils.checkpoint as ckpt
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    def wrap(fn):
        def core(*args, **kwargs):
            return ckpt.checkpoint(fn, *args, use_reentrant=False, **kwargs)
        return core

    patched: list[tuple[Any, str, Any]] = []
    modules = {sys.modules[type(m).__module__] for m in model.modules()}
    for mod in modules:
        if hasattr(mod, "eager_attention_forward"):
            patched.append((mod, "eager_attention_forward", mod.eager_attention_forward))
    key = "sdpa" if attention != "eager" else None
    old_sdpa = ALL_ATTENTION_FUNCTIONS[key] if key else None
    try:
        for mod, name, fn in patched:
            setattr(mod, name, wrap(fn))
        if key:
            ALL_ATTENTION_FUNCTIONS[key] = wrap(old_sdpa)
        yield
    finally:
        for mod, name, fn in patched:
            setattr(mod, name, fn)
        if key:
            ALL_ATTENTION_FUNCTIONS[key] = old_sdpa


def op_sac_context():
    """A fresh pair of selective-checkpoint contexts with torchtitan's op-level policy (one per
    checkpointed forward: the mm counter restarts each block).

    torchtitan/distributed/activation_checkpoint.py (b5bcd76) ``SelectiveAC._wrap_block``: the
    outputs of ``_get_default_save_ops`` -- torch._functorch.partitioners' compute-intensive ops
    (mm, addmm, bmm, the CUDA flash/efficient SDPA kernels, ...), aten.linear, max, topk, the
    cudnn SDPA kernel and the reduce-scatter/all-to-all collectives -- are MUST_SAVE, except
    every second mm (``forward_mm_count % 2 == 0`` after counting it), which is recomputed with
    everything else. Not modelled: its force-recompute mm shapes (MoE router gates) and its
    CUDA-to-CPU copies.
    """
    import torch
    from torch._functorch.partitioners import get_default_op_list
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    aten = torch.ops.aten
    save = {op.default for op in get_default_op_list().compute_intensive_ops}
    save |= {aten.linear.default, aten.max.default, aten.topk.default,
             aten._scaled_dot_product_cudnn_attention.default,
             torch.ops._c10d_functional.reduce_scatter_tensor.default,
             torch.ops._c10d_functional.all_to_all_single.default}
    mm_ops = (aten.mm.default, aten.linear.default)
    count = {"forward": 0, "recompute": 0}

    def policy(ctx, func, *args, **kwargs):
        mode = "recompute" if ctx.is_recompute else "forward"
        if func in mm_ops:
            count[mode] += 1
            if count[mode] % 2 == 0:
                return CheckpointPolicy.PREFER_RECOMPUTE
        return CheckpointPolicy.MUST_SAVE if func in save else CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)


def place_every_k_trace(impl: ImplSpec, par, num_layers: int) -> ImplSpec:
    """``impl`` with every-k counted over each pipeline rank's own blocks (``ImplSpec.counted_by_ranks``:
    torchtitan's per-process ``_layer_sac_count``) in the traced model's numbering: rank ``r`` builds global
    stages ``stage_ids(par, r)`` (``trace/parallel_pp.py``; torchtitan's ``pipeline_module_split`` builds a
    rank's stages in that order, and ``parallelize_fn`` runs ``apply_ac`` on each); ``impl`` itself without
    every-k or pipeline stages."""
    if par is None or impl.recompute != "every-k" or par.pp == 1:
        return impl
    from trainmem.trace.parallel_pp import stage_ids, stage_layers_of

    bounds = stage_layers_of(par, num_layers)
    return impl.counted_by_ranks([[bounds[g] for g in stage_ids(par, r)] for r in range(par.pp)], par.pp)


def enable_recompute(model, impl: ImplSpec, parallel=None) -> None:
    """Turn on ``impl``'s checkpointing in a transformers model; under ``parallel.pp`` every-k counts each
    pipeline rank's own blocks (:func:`place_every_k_trace`), as torchtitan wraps them after the cut."""
    if impl.recompute in ("full", "every-k", "op"):
        if not getattr(model, "supports_gradient_checkpointing", False):
            raise UnsupportedError(f"{type(model).__name__} does not support gradient checkpointing")
        kwargs = {"use_reentrant": False}
        if impl.recompute == "op":  # transformers passes these on to torch.utils.checkpoint.checkpoint
            kwargs["context_fn"] = op_sac_context
        if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5 (the old name warns)
            model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
        if impl.recompute == "every-k":
            from transformers.modeling_layers import GradientCheckpointingLayer
            layers = [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]
            impl = place_every_k_trace(impl, parallel, len(layers))
            for i, layer in enumerate(layers):
                layer.gradient_checkpointing = impl.checkpointed(i)
