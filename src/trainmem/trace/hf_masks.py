"""Transformers' attention-mask builder on fake tensors, made to take the branch the real run takes.

``transformers/masking_utils.py`` ``_preprocess_mask_arguments`` asks
``find_packed_sequence_indices`` whether the position ids pack several sequences when there is no
KV cache (activation checkpointing turns ``use_cache`` off). That function computes the packed
sequence ids and returns None when nothing is packed -- unless ``is_tracing(...)``, which counts a
FakeTensor: then it returns them as packed, and the fake run materializes a (B, 1, S, S) mask (a
bool and a 16-bit copy, kept per checkpointed block) where the real run passes ``is_causal``.

:func:`masks_as_on_real_tensors` sends fake ids to :func:`_unpacked`, which makes the
function's allocations in its order (and frees them in its order) and gives the answer the real
run reads for positions 0..S-1 in every row (what trace_step and the traced profile feed):
nothing packed. Real tensors go through the original unchanged.

The same holds for the SDPA mask skips: ``sdpa_mask`` asks ``_ignore_causal_mask_sdpa`` and
``_ignore_bidirectional_mask_sdpa`` whether a 2D padding mask leaves the mask out (SDPA's
``is_causal``, or no mask); both answer "keep it" when ``is_tracing(padding_mask)``, so on fake
tensors a (B, 1, S, S) bool mask (and its 16-bit copy) is made that the real run skips. BART's
decoder makes its own padding mask, ``torch.ones(batch_size, mask_seq_length)``
(transformers ``modeling_bart.py`` ``BartDecoder.forward``), when none is passed. A fake padding
mask is sent to the original function as a real all-ones mask of its shape and dtype: what the
steps trainmem traces feed (no ``attention_mask``: ``trace/step.py`` ``_inputs``).

Known limitations: a ``trace_model`` step that passes packed position ids itself is traced as not
packed on fake tensors, and one that passes a padding mask with zeros as not padded (fake tensors
hold no values to read).
"""

from __future__ import annotations

import contextlib

__all__ = ["masks_as_on_real_tensors"]


@contextlib.contextmanager
def masks_as_on_real_tensors():
    """Patch ``masking_utils.find_packed_sequence_indices`` for the block (see the module docstring)."""
    try:
        from transformers import masking_utils
    except ImportError:  # a custom model without transformers: nothing to patch
        yield
        return
    import torch
    from torch._subclasses.fake_tensor import is_fake

    original = getattr(masking_utils, "find_packed_sequence_indices", None)
    if original is None:  # a transformers without packed-sequence detection
        yield
        return

    def find_packed_sequence_indices(position_ids):
        # under torch.compile the real run takes the packed branch too (is_tracing counts Dynamo) and
        # the compiled model keeps the materialized mask (trace/compiled.py, docs/compile.md)
        if not torch.compiler.is_compiling() and is_fake(position_ids):
            return _unpacked(position_ids)
        return original(position_ids)

    skips = {name: getattr(masking_utils, name, None)
             for name in ("_ignore_causal_mask_sdpa", "_ignore_bidirectional_mask_sdpa")}
    masking_utils.find_packed_sequence_indices = find_packed_sequence_indices
    for name, skip in skips.items():
        if skip is not None:
            setattr(masking_utils, name, _on_all_ones(skip, torch, is_fake))
    try:
        yield
    finally:
        masking_utils.find_packed_sequence_indices = original
        for name, skip in skips.items():
            if skip is not None:
                setattr(masking_utils, name, skip)


def _on_all_ones(skip, torch, is_fake):
    """``skip(padding_mask, ...)`` (transformers/masking_utils.py ``_ignore_causal_mask_sdpa``,
    ``_ignore_bidirectional_mask_sdpa``, called by ``sdpa_mask``) asked about a real all-ones mask
    when the padding mask is fake: the answer the real run gives for a model-made ``torch.ones``."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    def patched(padding_mask, *args, **kwargs):
        if padding_mask is not None and not torch.compiler.is_compiling() and is_fake(padding_mask):
            with unset_fake_temporarily():  # its checks read values: run them on real tensors
                return skip(torch.ones(padding_mask.shape, dtype=padding_mask.dtype), *args, **kwargs)
        return skip(padding_mask, *args, **kwargs)
    return patched


def _unpacked(position_ids):
    """``find_packed_sequence_indices`` (transformers/masking_utils.py) on ids whose values cannot
    be read: the same ops, alive and freed in the same order as there (the packed-sequence ids,
    the all-zero check on their last column, then the locals at return), answering "not packed"."""
    import torch

    before_first = position_ids[:, :1] - 1
    steps = torch.diff(position_ids, prepend=before_first, dim=-1)
    sequence_ids = (steps != 1).cumsum(-1)
    (sequence_ids[:, -1] == 0).all()  # the check whose answer (True: one sequence per row) is given
    return None
