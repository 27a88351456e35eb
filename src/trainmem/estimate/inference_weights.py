"""Serving weights per rank: the weight formats and vLLM's tensor-parallel rule.

Formats (bytes of one linear ``out × in`` on a rank, scales included)::

    bf16, fp16   out·in·2
    fp8          out·in·1 + 4                   one fp32 scale per weight (vLLM fp8.py,
                                                Fp8LinearMethod.create_weights: PerTensorScaleParameter)
    int8         out·in·1 + out·4               fp32 scale per output channel (vLLM
                                                compressed_tensors_w8a8_int8.py: ChannelQuantScaleParameter)
    int4 (G)     out·in/2 + (in/G)·out·2 + (in/G)·out/2
                                                AutoAWQ's GEMM packing (awq/modules/linear/gemm.py, WQLinear_GEMM):
                                                qweight int32 [in, out/8] (8 weights per int32),
                                                scales fp16 [in/G, out], qzeros int32 [in/G, out/8]

Only the linears of the blocks are quantized: embeddings, the LM head and norms stay 16-bit (vLLM
quantizes neither by default: VocabParallelEmbedding/ParallelLMHead take no quant_method unless
the checkpoint says so).

Tensor parallelism (vLLM, model_executor/layers/linear.py; which module is which: the family's
``Family.tp`` roles in ``trainmem/families/``): q/gate/up are column-parallel (output
rows ÷ tp), o/down row-parallel (input columns ÷ tp), embeddings and head vocab-parallel (⌈V/tp⌉
rows; vLLM also pads V to a multiple of 64, not modelled). K and V heads: QKVParallelLinear keeps
``Akv/tp`` heads per rank when ``tp ≤ Akv`` and replicates them when ``tp > Akv`` (each rank one KV
head, ``tp/Akv`` replicas), so every rank keeps at least one.

Known limitations: per-rank and quantized weights are modelled for Llama-style separate q/k/v/o and
gate/up/down projections (fused QKV such as GPT-2's c_attn, and MoE experts, are refused); GPTQ's
act-order g_idx (int32 [in]) is not counted.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from trainmem.errors import SpecError
from trainmem.families import family_of
from trainmem.inventory import Category, MemoryItem
from trainmem.specs import ModelSpec

__all__ = ["WEIGHT_FORMATS", "KV_DTYPES", "WeightFormat", "linear_bytes", "kv_heads_per_rank", "check_tp",
           "rank_weight_items"]


def _dense(out: int, inp: int, group: int) -> int:
    return out * inp * 2


def _fp8(out: int, inp: int, group: int) -> int:
    return out * inp + 4


def _int8(out: int, inp: int, group: int) -> int:
    return out * inp + out * 4


def _int4(out: int, inp: int, group: int) -> int:
    groups = inp // group
    return out * inp // 2 + groups * out * 2 + groups * out // 2


@dataclass(frozen=True)
class WeightFormat:
    name: str
    dtype: str
    """The inventory dtype of a quantized linear's weight."""
    bytes_of: object
    """(out, in, group) -> bytes of one linear, scales included."""
    grouped: bool = False


WEIGHT_FORMATS = {
    "bf16": WeightFormat("bf16", "bfloat16", _dense),
    "fp16": WeightFormat("fp16", "float16", _dense),
    "fp8": WeightFormat("fp8", "float8", _fp8),
    "int8": WeightFormat("int8", "int8", _int8),
    "int4": WeightFormat("int4", "int4", _int4, grouped=True),
}
KV_DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp8": "float8"}
"""--kv-dtype: vLLM's kv_cache_dtype (fp8 = fp8_e4m3, one byte per element; its per-layer k/v scales
are two fp32 scalars, not counted)."""



def linear_bytes(fmt: str, out: int, inp: int, group: int = 128) -> int:
    """Bytes of one ``out × in`` linear in format ``fmt`` (scales and zeros included)."""
    f = WEIGHT_FORMATS[fmt]
    if f.grouped and (inp % group or out % 8):
        raise SpecError("weight_group", group, f"must divide the linear's input width {inp} "
                                               f"(and 8 its output width {out}) for int4 packing")
    return f.bytes_of(out, inp, group)


def kv_heads_per_rank(model: ModelSpec, tp: int) -> int:
    """KV heads one TP rank keeps (vLLM QKVParallelLinear.__init__: replicated when tp > Akv)."""
    return max(1, model.num_kv_heads // tp)


def check_tp(model: ModelSpec, tp: int) -> None:
    """vLLM's divisibility rules (linear.py: ``divide`` asserts exact division)."""
    akv = model.num_kv_heads
    what = f"(heads={model.num_heads}, kv_heads={akv}, ffn_size={model.ffn_size})"
    if model.num_heads % tp or model.ffn_size % tp:
        raise SpecError("tp", tp, f"must divide num_heads and ffn_size {what}")
    if (akv % tp if akv >= tp else tp % akv):
        raise SpecError("tp", tp, f"must divide kv_heads, or be a multiple of it (heads replicated) {what}")


def _kind(model: ModelSpec, name: str) -> str:
    """The vLLM layer a parameter belongs to, by its family's TP roles (``Family.tp``): ``kv``
    (QKVParallelLinear's K/V heads), ``column``, ``row``, ``vocab``; ``other`` for packed projections
    and GPT-2's ``Conv1D`` (stored ``[in, out]``), whose per-rank split is not modelled."""
    fam = family_of(model)
    if fam.conv1d:
        return "other"
    module = name.rsplit(".", 1)[0]  # model.layers.0.self_attn.q_proj.weight -> ...q_proj
    roles = fam.tp
    for kind, names in (("other", roles.packed), ("kv", roles.kv), ("column", roles.column), ("row", roles.row),
                        ("vocab", roles.vocab)):
        if any(module == n or module.endswith("." + n) for n in names):
            return kind
    return "other"


def rank_weight_items(model: ModelSpec, params: list[MemoryItem], *, tp: int, weights: str | None,
                      dense_dtype: str, group: int) -> list[MemoryItem]:
    """Each parameter as one TP rank holds it in format ``weights`` (None: as stored, ``params``' dtypes)."""
    simple = tp == 1 and weights is None
    if not simple and (model.is_moe or model.arch != "decoder"):
        raise SpecError("weights" if weights else "tp", weights or tp,
                        f"serving per rank and quantized weights are modelled for dense decoders, not {model.name}")
    kv_local = kv_heads_per_rank(model, tp) * model.head_dim
    out_items = []
    for it in params:
        if simple:
            out_items.append(it)
            continue
        kind = _kind(model, it.name)
        if kind == "other" and len(it.shape) > 1:
            raise SpecError("weights" if weights else "tp", weights or tp,
                            f"{it.name} is not a Llama-style projection (q/k/v/o, gate/up/down): not modelled")
        shape = list(it.shape)
        if kind == "column":
            shape[0] //= tp
        elif kind == "kv":
            shape[0] = kv_local
        elif kind == "row" and len(shape) == 2:
            shape[1] //= tp
        elif kind == "vocab":
            shape[0] = -(-shape[0] // tp)
        if len(shape) == 2 and kind != "vocab" and weights is not None:
            fmt = WEIGHT_FORMATS[weights]
            nbytes = linear_bytes(weights, shape[0], shape[1], group)
            dtype = fmt.dtype
            text = f"{weights} {shape[0]}×{shape[1]}" + (f", G={group}" if fmt.grouped else "")
        else:
            dtype = dense_dtype if weights is not None else it.dtype
            numel = math.prod(shape)
            nbytes = numel * (2 if weights is not None else it.bytes // max(1, math.prod(it.shape)))
            text = "×".join(str(s) for s in shape) + f"·{nbytes // numel}"
        out_items.append(MemoryItem.make(it.name, Category.PARAMETER, tuple(shape), dtype, nbytes, text))
    return out_items

