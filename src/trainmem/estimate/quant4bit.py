"""How a 4-bit QLoRA base weight is stored: one layout per implementation (``FinetuneSpec.quant_impl``).

* ``bnb`` -- bitsandbytes' ``Params4bit`` (``bitsandbytes/functional.py`` ``quantize_4bit``; what
  transformers' ``BitsAndBytesConfig(load_in_4bit=True)`` builds): packed codes, two per uint8;
  one absmax per ``quant_block`` weights, fp32 -- or, with double quantization
  (``bnb_4bit_use_double_quant``, ``compress_statistics``), the absmax minus their mean quantized to
  uint8 by ``quantize_blockwise`` in blocks of 256 (one fp32 constant each), the fp32 mean
  (``offset``) and that blockwise quantizer's own 256-entry fp32 dynamic map; plus the 16-entry
  fp32 NF4/FP4 code book.
* ``torchao-nf4`` -- torchao's ``NF4Tensor`` (``torchao/quantization/quantize_/workflows/nf4/
  nf4_tensor.py`` ``NF4Tensor.from_tensor``, ``double_quantize_scalers``; what torchtune's QLoRA
  builds with ``to_nf4``): packed codes (uint8, two per byte); the block absmax minus their mean
  as int8 ``quantized_scalers``, one per ``quant_block`` (64) weights; one
  ``quantization_factor`` per ``double_quant_block`` (256) scalers and the scalers' mean, both in
  the weight's own dtype; the 16-entry NF4 table in the weight's dtype. Always double quantized;
  the weight must split into whole blocks of 64 · 256 (``from_tensor`` asserts it).

Both were checked byte for byte on CPU (bitsandbytes 0.50.2, torchao 0.18.0:
``tests/finetune/test_variants.py``).
"""

from __future__ import annotations

import math
from typing import Callable

from trainmem.errors import SpecError
from trainmem.inventory import Category, MemoryItem, dtype_bytes

__all__ = ["DEQUANTIZES_TO", "QUANT_LAYOUTS", "quantized_weight_items"]

#: a bitsandbytes weight's note names, after this, the dtype it was quantized from, which ``dequantize_4bit``
#: returns (``QuantState.dtype``), whatever the compute dtype (read by estimate/quant4bit_moments.py)
DEQUANTIZES_TO = "dequantizes to "

_P = Category.PARAMETER


def _make(name: str, shape: tuple[int, ...], dtype: str, nbytes: int, formula: str, note: str = "") -> MemoryItem:
    return MemoryItem(name=name, category=_P, shape=tuple(shape), dtype=dtype, bytes=int(nbytes), formula=formula,
                      note=note)


def _bnb(name: str, shape: tuple[int, ...], spec, weight_dtype: str) -> list[MemoryItem]:
    n = math.prod(shape)
    qb, qb2 = spec.quant_block, spec.double_quant_block
    blocks = -(-n // qb)
    out = [_make(name, shape, spec.quant_type, -(-n // 2), "⌈numel/2⌉·1 (packed uint8)",
                 f"{spec.quant_type} 4-bit base (bitsandbytes), frozen; {DEQUANTIZES_TO}{weight_dtype}")]
    if spec.double_quant:
        blocks2 = -(-blocks // qb2)
        out += [_make(f"{name}.absmax", (blocks,), "uint8", blocks, f"⌈numel/{qb}⌉·1 (8-bit absmax)"),
                _make(f"{name}.absmax2", (blocks2,), "float32", blocks2 * 4, f"⌈numel/{qb}/{qb2}⌉·4"),
                _make(f"{name}.absmax_offset", (), "float32", 4, "1·4"),
                _make(f"{name}.absmax_code", (256,), "float32", 1024, "256·4 (8-bit dynamic map, one per weight)")]
    else:
        out.append(_make(f"{name}.absmax", (blocks,), "float32", blocks * 4, f"⌈numel/{qb}⌉·4"))
    out.append(_make(f"{name}.quant_code", (16,), "float32", 64, "16·4 (4-bit code book)"))
    return out


def _torchao_nf4(name: str, shape: tuple[int, ...], spec, weight_dtype: str) -> list[MemoryItem]:
    n = math.prod(shape)
    qb, qb2 = spec.quant_block, spec.double_quant_block
    if n % (qb * qb2):
        raise SpecError("quant_impl", "torchao-nf4", f"{name} has {n} weights; torchao's to_nf4 needs a multiple "
                                                     f"of {qb}·{qb2} = {qb * qb2} (quant_block·double_quant_block)")
    blocks, blocks2, b = n // qb, n // qb // qb2, dtype_bytes(weight_dtype)
    # quantization_factor[:, 0] of the (blocks2, 256) quotient: .contiguous() copies it out, except
    # when blocks2 == 1, where the one-element view is contiguous already and keeps all 256 entries
    factor = (blocks2 * b, f"numel/{qb}/{qb2}·{b:g}") if blocks2 > 1 else (
        qb2 * b, f"{qb2}·{b:g} (one scaler block: a view of the whole (1, {qb2}) quotient)")
    return [_make(name, shape, "nf4", n // 2, "numel/2·1 (quantized_data, packed uint8)",
                  "nf4 4-bit base (torchao NF4Tensor), frozen"),
            _make(f"{name}.quantized_scalers", (blocks,), "int8", blocks, f"numel/{qb}·1 (int8 block scalers)"),
            _make(f"{name}.quantization_factor", (blocks2,), weight_dtype, *factor),
            _make(f"{name}.scaler_mean", (), weight_dtype, b, f"1·{b:g}"),
            _make(f"{name}.nf4", (16,), weight_dtype, 16 * b, f"16·{b:g} (NF4 table)")]


#: quant_impl -> ``(name, shape, spec, weight dtype) -> items`` of one quantized weight.
QUANT_LAYOUTS: dict[str, Callable[..., list[MemoryItem]]] = {"bnb": _bnb, "bnb-legacy": _bnb,  # same Params4bit
                                                              "torchao-nf4": _torchao_nf4}


def quantized_weight_items(name: str, shape: tuple[int, ...], spec, weight_dtype: str) -> list[MemoryItem]:
    """The storage of one 4-bit weight under ``spec.quant_impl`` (``weight_dtype``: the dtype it
    was quantized from, which torchao keeps its constants in)."""
    return QUANT_LAYOUTS[spec.quant_impl](name, shape, spec, weight_dtype)
