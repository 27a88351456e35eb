"""Registered buffers of a family's model (``named_buffers()``), declared per family.

A buffer is device memory the model holds all step, neither a parameter nor an activation:
transformers 5.24's rotary embeddings register ``inv_freq`` and a copy, ``original_inv_freq``
(``LlamaRotaryEmbedding.__init__`` and every family's copy of it: ``nn.Buffer(inv_freq,
persistent=False)`` twice), one pair per model under ``<model>.rotary_emb``, not per layer;
Gemma-3 registers a pair per attention type (``Gemma3RotaryEmbedding``: ``{layer_type}_inv_freq``).
``inv_freq`` is ``1 / base ** (arange(0, dim, 2, dtype=float) / dim)``: ceil(dim/2) fp32 values,
fp32 whatever the model's dtype (built under a 16-bit default dtype, as ``from_pretrained`` and the
tracer build it, the explicit ``dtype=torch.float`` wins). BERT's ``BertEmbeddings`` registers
``position_ids`` and ``token_type_ids``, (1, max_position_embeddings) int64 each; DeepSeek-V3's
router ``e_score_correction_bias`` (n_routed_experts fp32, kept fp32 by
``_keep_in_fp32_modules_strict``) per MoE block. GPT-2 registers none in 5.24 (its causal ``bias``
buffer is gone: masks come from ``masking_utils``).

A family declares them with :attr:`trainmem.families.base.Family.buffers`, a function
``ModelSpec -> tuple[Buffer, ...]``; the estimator turns them into ``buffer`` items
(``estimate/buffers.py``). ``tests/families/test_family_buffers.py`` checks every family's
declaration against the ``named_buffers()`` of a real transformers build.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # pragma: no cover
    from trainmem.specs.model import ModelSpec

__all__ = ["Buffer", "PARAM_DTYPE", "rotary_width", "rotary", "rotary_buffers", "no_buffers", "bert_buffers",
           "gemma_buffers", "gemma3_buffers", "deepseek_v3_buffers", "generic_buffers"]

#: a buffer made under the default dtype the model is built in: the parameters' dtype
PARAM_DTYPE = "param"


@dataclass(frozen=True)
class Buffer:
    """One registered buffer: its ``named_buffers()`` name, shape, one symbolic expression per axis
    (``trainmem.estimate.symbols``) and dtype (:data:`PARAM_DTYPE`: the parameters' dtype)."""

    name: str
    shape: tuple[int, ...]
    dims: tuple[str, ...]
    dtype: str


def rotary_width(m: "ModelSpec") -> int:
    """The dims RoPE rotates per head: MLA's ``qk_rope_head_dim``, a partial ``rotary_dim``
    (GPT-NeoX, Qwen3-Next), else the whole head."""
    return m.qk_rope_head_dim if m.kv_lora_rank else (m.rotary_dim or m.head_dim)


def rotary(module: str, m: "ModelSpec", prefix: str = "") -> tuple[Buffer, ...]:
    """``inv_freq`` and ``original_inv_freq`` of the rotary module ``module`` (``prefix``: Gemma-3's
    layer type, ``sliding_attention_``)."""
    width = rotary_width(m)
    n = (width + 1) // 2  # len(arange(0, dim, 2))
    dims = ("hd/2",) if width == m.head_dim and not width % 2 else ("rot/2",) if (
        width == (m.rotary_dim or m.head_dim) and not width % 2) else (str(n),)
    return tuple(Buffer(f"{module}.{prefix}{b}", (n,), dims, "float32") for b in ("inv_freq", "original_inv_freq"))


def no_buffers(m: "ModelSpec") -> tuple[Buffer, ...]:
    return ()


def rotary_buffers(m: "ModelSpec") -> tuple[Buffer, ...]:
    """The Llama layout's: one rotary module, ``model.rotary_emb``."""
    return rotary("model.rotary_emb", m)


def generic_buffers(m: "ModelSpec") -> tuple[Buffer, ...]:
    """``generic`` (Llama names): the rotary pair unless positions are learned."""
    return () if m.max_positions else rotary_buffers(m)


def gemma_buffers(m: "ModelSpec") -> tuple[Buffer, ...]:
    """Gemma/Gemma-2: ``GemmaTextScaledWordEmbedding.embed_scale`` (a 0-d tensor of sqrt(H) made
    under the default dtype) and the rotary pair."""
    return (Buffer("model.embed_tokens.embed_scale", (), (), PARAM_DTYPE), *rotary_buffers(m))


def gemma3_buffers(m: "ModelSpec") -> tuple[Buffer, ...]:
    """Gemma-3: the scale, and a rotary pair per attention type its blocks use
    (``Gemma3RotaryEmbedding``: ``set(config.layer_types)``)."""
    types = sorted({"sliding_attention" if k.attention == "sliding" else "full_attention" for k in m.kinds})
    return (Buffer("model.embed_tokens.embed_scale", (), (), PARAM_DTYPE),
            *(b for t in types for b in rotary("model.rotary_emb", m, f"{t}_")))


def deepseek_v3_buffers(m: "ModelSpec") -> tuple[Buffer, ...]:
    """DeepSeek-V3: the rotary pair and each MoE block's router ``e_score_correction_bias``."""
    bias = tuple(Buffer(f"model.layers.{i}.mlp.gate.e_score_correction_bias", (m.num_experts,), ("E",), "float32")
                 for i, k in enumerate(m.kinds) if k.mlp == "moe")
    return (*bias, *rotary_buffers(m))


def bert_buffers(m: "ModelSpec") -> tuple[Buffer, ...]:
    """BERT: ``BertEmbeddings.position_ids`` and ``token_type_ids``, (1, max_positions) int64."""
    return tuple(Buffer(f"bert.embeddings.{b}", (1, m.max_positions), ("1", str(m.max_positions)), "int64")
                 for b in ("position_ids", "token_type_ids"))
