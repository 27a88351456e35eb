"""Every trainable parameter of a :class:`ModelSpec`: its Hugging Face name and exact shape.

The list matches ``[(n, tuple(p.shape)) for n, p in model.named_parameters()]`` of the model
``trainmem.models.hf.build_hf_model`` builds (transformers 5.x; causal-LM head, masked-LM head for
``bert``): same names, same order, tied weights once under the embedding's name. Family ``generic``,
and the ``llama``-like families, use Llama names.

Known limitations:
  - Names follow transformers 5.x module layouts (e.g. Mixtral experts as fused 3-D
    ``experts.gate_up_proj``; GPT-NeoX's head as ``lm_head``). 4.x names differ; shapes and counts do not.
  - Spec features a family's HF code does not have are still counted, with the nearest name
    (a gated MLP in ``gpt2``/``gpt_neox``/``bert`` is one packed ``[2F, H]`` up-projection);
    features with no sensible name there (MoE, QK-norm, extra embeddings) raise ``UnsupportedError``.
"""

from __future__ import annotations

from math import prod
from typing import Callable

from trainmem.errors import UnsupportedError
from trainmem.specs.model import ModelSpec

__all__ = ["Shape", "parameter_shapes", "count_parameters"]

Shape = tuple[int, ...]
_Params = list[tuple[str, Shape]]


def _linear(name: str, out_features: int, in_features: int, bias: bool) -> _Params:
    """``nn.Linear``: weight ``[out, in]``, then bias ``[out]``."""
    params = [(f"{name}.weight", (out_features, in_features))]
    if bias:
        params.append((f"{name}.bias", (out_features,)))
    return params


def _conv1d(name: str, in_features: int, out_features: int, bias: bool) -> _Params:
    """GPT-2's ``Conv1D`` stores the weight transposed: ``[in, out]``."""
    params = [(f"{name}.weight", (in_features, out_features))]
    if bias:
        params.append((f"{name}.bias", (out_features,)))
    return params


def _norm(m: ModelSpec, name: str, size: int | None = None) -> _Params:
    size = m.hidden_size if size is None else size
    params = [(f"{name}.weight", (size,))]
    if m.norm == "layernorm" and m.norm_bias:
        params.append((f"{name}.bias", (size,)))
    return params


def _embedding(name: str, rows: int, width: int) -> _Params:
    return [(f"{name}.weight", (rows, width))]


def _up_width(m: ModelSpec, ffn_size: int) -> int:
    """Output width of the (packed) up-projection: gate and value branches for gated activations."""
    return 2 * ffn_size if m.gated else ffn_size


def _refuse(m: ModelSpec, *features: str) -> None:
    present = {
        "MoE": m.is_moe,
        "qk_norm": m.qk_norm,
        "max_positions": m.max_positions > 0,
        "type_vocab_size": m.type_vocab_size > 0,
    }
    used = [f for f in features if present[f]]
    if used:
        raise UnsupportedError(
            f"family {m.family!r} has no parameter layout for {', '.join(used)} "
            f"(model {m.name!r}); use family 'generic' for Llama-style names"
        )


# Llama and its relatives -------------------------------------------------------------------------
def _llama_mlp(m: ModelSpec, pre: str) -> _Params:
    H, bias = m.hidden_size, m.mlp_bias
    if not m.is_moe:
        return _dense_mlp(m, pre, m.ffn_size)
    E, F = m.num_experts, m.expert_ffn_size
    # MixtralSparseMoeBlock: router, then experts as fused 3-D tensors
    params: _Params = [(f"{pre}.gate.weight", (E, H))]
    up = "gate_up_proj" if m.gated else "up_proj"
    params.append((f"{pre}.experts.{up}", (E, _up_width(m, F), H)))
    if bias:
        params.append((f"{pre}.experts.{up}_bias", (E, _up_width(m, F))))
    params.append((f"{pre}.experts.down_proj", (E, H, F)))
    if bias:
        params.append((f"{pre}.experts.down_proj_bias", (E, H)))
    if m.num_shared_experts:
        # DeepSeek-style: one dense MLP as wide as all shared experts together
        params += _dense_mlp(m, f"{pre}.shared_experts", m.num_shared_experts * F)
    return params


def _dense_mlp(m: ModelSpec, pre: str, F: int) -> _Params:
    H, bias = m.hidden_size, m.mlp_bias
    params: _Params = []
    if m.gated:
        params += _linear(f"{pre}.gate_proj", F, H, bias)
    params += _linear(f"{pre}.up_proj", F, H, bias)
    params += _linear(f"{pre}.down_proj", H, F, bias)
    return params


def _llama(m: ModelSpec) -> _Params:
    H = m.hidden_size
    params = _embedding("model.embed_tokens", m.vocab_size, H)
    if m.max_positions:
        params += _embedding("model.embed_positions", m.max_positions, H)
    if m.type_vocab_size:
        params += _embedding("model.embed_token_types", m.type_vocab_size, H)
    for i in range(m.num_layers):
        pre = f"model.layers.{i}"
        attn = f"{pre}.self_attn"
        params += _linear(f"{attn}.q_proj", m.q_size, H, m.qkv_bias)
        params += _linear(f"{attn}.k_proj", m.kv_size, H, m.qkv_bias)
        params += _linear(f"{attn}.v_proj", m.kv_size, H, m.qkv_bias)
        params += _linear(f"{attn}.o_proj", H, m.q_size, m.out_bias)
        if m.qk_norm:
            params += _norm(m, f"{attn}.q_norm", m.head_dim)
            params += _norm(m, f"{attn}.k_norm", m.head_dim)
        params += _llama_mlp(m, f"{pre}.mlp")
        params += _norm(m, f"{pre}.input_layernorm")
        params += _norm(m, f"{pre}.post_attention_layernorm")
        if m.family == "gemma2":  # sandwich norms around the MLP
            params += _norm(m, f"{pre}.pre_feedforward_layernorm")
            params += _norm(m, f"{pre}.post_feedforward_layernorm")
    params += _norm(m, "model.norm")
    return params + _lm_head(m)


def _phi3(m: ModelSpec) -> _Params:
    _refuse(m, "MoE", "qk_norm", "max_positions", "type_vocab_size")
    H, F = m.hidden_size, m.ffn_size
    params = _embedding("model.embed_tokens", m.vocab_size, H)
    for i in range(m.num_layers):
        pre = f"model.layers.{i}"
        # Phi3Attention registers o_proj before the fused qkv_proj
        params += _linear(f"{pre}.self_attn.o_proj", H, m.q_size, m.out_bias)
        params += _linear(f"{pre}.self_attn.qkv_proj", m.q_size + 2 * m.kv_size, H, m.qkv_bias)
        params += _linear(f"{pre}.mlp.gate_up_proj", _up_width(m, F), H, m.mlp_bias)
        params += _linear(f"{pre}.mlp.down_proj", H, F, m.mlp_bias)
        params += _norm(m, f"{pre}.input_layernorm")
        params += _norm(m, f"{pre}.post_attention_layernorm")
    params += _norm(m, "model.norm")
    return params + _lm_head(m)


def _lm_head(m: ModelSpec) -> _Params:
    return [] if m.tied_embeddings else _embedding("lm_head", m.vocab_size, m.hidden_size)


# GPT-2, GPT-NeoX, BERT ---------------------------------------------------------------------------
def _gpt2(m: ModelSpec) -> _Params:
    _refuse(m, "MoE", "qk_norm", "type_vocab_size")
    H, F = m.hidden_size, m.ffn_size
    params = _embedding("transformer.wte", m.vocab_size, H)
    if m.max_positions:
        params += _embedding("transformer.wpe", m.max_positions, H)
    for i in range(m.num_layers):
        pre = f"transformer.h.{i}"
        params += _norm(m, f"{pre}.ln_1")
        params += _conv1d(f"{pre}.attn.c_attn", H, m.q_size + 2 * m.kv_size, m.qkv_bias)
        params += _conv1d(f"{pre}.attn.c_proj", m.q_size, H, m.out_bias)
        params += _norm(m, f"{pre}.ln_2")
        params += _conv1d(f"{pre}.mlp.c_fc", H, _up_width(m, F), m.mlp_bias)
        params += _conv1d(f"{pre}.mlp.c_proj", F, H, m.mlp_bias)
    params += _norm(m, "transformer.ln_f")
    return params + _lm_head(m)


def _gpt_neox(m: ModelSpec) -> _Params:
    _refuse(m, "MoE", "qk_norm", "max_positions", "type_vocab_size")
    H, F = m.hidden_size, m.ffn_size
    params = _embedding("gpt_neox.embed_in", m.vocab_size, H)
    for i in range(m.num_layers):
        pre = f"gpt_neox.layers.{i}"
        params += _norm(m, f"{pre}.input_layernorm")
        params += _norm(m, f"{pre}.post_attention_layernorm")
        params += _linear(f"{pre}.attention.query_key_value", m.q_size + 2 * m.kv_size, H, m.qkv_bias)
        params += _linear(f"{pre}.attention.dense", H, m.q_size, m.out_bias)
        params += _linear(f"{pre}.mlp.dense_h_to_4h", _up_width(m, F), H, m.mlp_bias)
        params += _linear(f"{pre}.mlp.dense_4h_to_h", H, F, m.mlp_bias)
    params += _norm(m, "gpt_neox.final_layer_norm")
    return params + _lm_head(m)


def _bert(m: ModelSpec) -> _Params:
    _refuse(m, "MoE", "qk_norm")
    H, F, V = m.hidden_size, m.ffn_size, m.vocab_size
    params = _embedding("bert.embeddings.word_embeddings", V, H)
    if m.max_positions:
        params += _embedding("bert.embeddings.position_embeddings", m.max_positions, H)
    if m.type_vocab_size:
        params += _embedding("bert.embeddings.token_type_embeddings", m.type_vocab_size, H)
    params += _norm(m, "bert.embeddings.LayerNorm")
    for i in range(m.num_layers):
        pre = f"bert.encoder.layer.{i}"
        params += _linear(f"{pre}.attention.self.query", m.q_size, H, m.qkv_bias)
        params += _linear(f"{pre}.attention.self.key", m.kv_size, H, m.qkv_bias)
        params += _linear(f"{pre}.attention.self.value", m.kv_size, H, m.qkv_bias)
        params += _linear(f"{pre}.attention.output.dense", H, m.q_size, m.out_bias)
        params += _norm(m, f"{pre}.attention.output.LayerNorm")
        params += _linear(f"{pre}.intermediate.dense", _up_width(m, F), H, m.mlp_bias)
        params += _linear(f"{pre}.output.dense", H, F, m.mlp_bias)
        params += _norm(m, f"{pre}.output.LayerNorm")
    # BertLMPredictionHead: its own output bias is registered before its submodules
    params.append(("cls.predictions.bias", (V,)))
    params += _linear("cls.predictions.transform.dense", H, H, True)
    params += _norm(m, "cls.predictions.transform.LayerNorm")
    if not m.tied_embeddings:
        # untied, the decoder keeps its own weight and bias (transformers 5.x)
        params += _linear("cls.predictions.decoder", V, H, True)
    return params


_LAYOUTS: dict[str, Callable[[ModelSpec], _Params]] = {
    "gpt2": _gpt2, "gpt_neox": _gpt_neox, "phi3": _phi3, "bert": _bert,
}


def parameter_shapes(model: ModelSpec) -> list[tuple[str, Shape]]:
    """``(name, shape)`` of every trainable parameter, in ``named_parameters()`` order."""
    return _LAYOUTS.get(model.family, _llama)(model)


def count_parameters(model: ModelSpec) -> int:
    """Number of trainable scalars; tied weights count once."""
    return sum(prod(shape) for _, shape in parameter_shapes(model))
