"""What FSDP2 all-gathers for a torchao NF4 base weight (QLoRA, ``--quant-impl torchao-nf4`` under
``--fsdp``).

FSDP2 asks a tensor subclass for its all-gather inputs (``torch/distributed/fsdp/_fully_shard/
_fsdp_param.py`` ``FSDPParam.all_gather_inputs``: ``fsdp_pre_all_gather`` when the local tensor has
it). torchao's ``NF4Tensor.fsdp_pre_all_gather`` (``torchao/quantization/quantize_/workflows/nf4/
nf4_tensor.py``) returns the shard's ``quantized_scalers`` (int8), ``quantization_factor`` (the
weight's dtype) and ``quantized_data`` (packed uint8, two weights a byte); ``fsdp_post_all_gather``
rebuilds an ``NF4Tensor`` on the gathered storages, with the ``scaler_mean`` and NF4 table from the
metadata. So a block's gathered weights are its NF4 storages, about numel·(1/2 + 1/64 + ...) bytes,
not numel·2 of ``MixedPrecisionPolicy.param_dtype``; the dequantized copy is made per matmul
(``linear_nf4``), counted as the QLoRA dequant temporary.

Each quantized weight's items (``estimate/quant4bit.py`` ``_torchao_nf4``) are gathered in their own
dtype: the codes (``nf4``, numel/2 bytes), the int8 scalers and the quantization factors; the scaler
mean and the 16-entry table travel as metadata (0 bytes). Checked against torchao's own
``fsdp_pre_all_gather`` on CPU (``tests/estimate/test_fsdp_quant.py``).
"""

from __future__ import annotations

import math

from trainmem.inventory import MemoryItem, dtype_bytes

__all__ = ["NF4_DTYPE", "quantized_gather_bytes"]

NF4_DTYPE = "nf4"
_GATHERED = (".quantized_scalers", ".quantization_factor")  # all-gather inputs besides the codes
_METADATA = (".scaler_mean", ".nf4")  # in fsdp_pre_all_gather's metadata, not gathered


def quantized_gather_bytes(item: MemoryItem, nf4_weights: set[str]) -> float | None:
    """Bytes per element FSDP2 all-gathers for ``item`` if it is part of a torchao NF4 weight
    (``nf4_weights``: the names of the ``nf4`` items), else None (the caller's rule applies)."""
    if item.dtype == NF4_DTYPE:
        return item.bytes / math.prod(item.shape)
    base, dot, suffix = item.name.rpartition(".")
    if not dot or base not in nf4_weights:
        return None
    if "." + suffix in _GATHERED:  # the tensor's elements (a one-block factor is a view of a longer storage)
        return dtype_bytes(item.dtype)
    if "." + suffix in _METADATA:
        return 0.0
    return None
