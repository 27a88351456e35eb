"""A forward moment inside the last block: its LoRA-adapted down projection's adapter sum, or its frozen 4-bit
down projection's matmul (QLoRA on the attention: :func:`_four_bit_down_moment`), the ``forward`` phase where it is
the larger; or its adapted fused QKV projection's (GPT-NeoX's ``query_key_value``, peft's default target: the
same tensors, with the block's normed input for the local and nothing of the attention yet; tiny GPT-NeoX LoRA bf16
B1 S32 was 32,496 B under the trace's forward top, now equal: ``tests/estimate/test_adapter_forward_qkv.py``). The
4-bit one: tiny Llama (h64, F176, V128) QLoRA q/v amp-bf16 B2 S64 was 2,024 B under the trace, now
equal (``tests/finetune/test_qlora_cast_moments.py``).

peft's ``lora.Linear.forward`` (peft ``tuners/lora/layer.py``) runs ``result = self.base_layer(x)``, then
``x = self._cast_input_dtype(x, lora_A.weight.dtype)`` and ``result = result + lora_B(lora_A(dropout(x))) *
scaling``. When ``* scaling`` has made its output, the forward holds, besides every tensor saved so far:

* the base layer's output (``result``, the residual's shape in the product's dtype), ``lora_B``'s output and its
  scaled copy (in ``lora_B``'s output dtype: the product's under autocast, else the adapter's), and peft's copy of
  the product in the adapter's dtype when the two differ (fp32 adapters on a bf16 product);
* the block's locals, saved or not: the MLP's input (the norm's output: under autocast the adapters' ``lora_A``
  save bf16 casts of it, a frozen base layer saves nothing), the down projection's input (the product, GPT-NeoX's
  GELU output), a parallel-residual block's attention output (``GPTNeoXLayer.forward``: ``mlp_output + attn_output
  + hidden_states``; ``recompute_stop._attention_output_held``);
* the model's locals (transformers ``LlamaModel.forward`` / ``GPTNeoXModel.forward``): ``inputs_embeds`` (the
  embedding's output, which no node saves behind a frozen embedding with no checkpoint) and ``cache_position``
  (an int64 ``arange`` of S; ``position_ids`` is its view);
* what the forward phase holds to the loss (the KV cache's copies, autocast's cached weight copies:
  ``estimate/forward_held.py``), but neither the final norm's and head's outputs nor anything saved after the
  adapter (the block's output sum, the final norm's, the head's and the loss's saved tensors).

With a small vocabulary (the logits smaller than the product's fp32 copy) this is the step's top: tiny GPT-NeoX
(h128, F512, V128) LoRA on every linear, amp-bf16, B1 S32, was 57,072 B under the trace (B2 S64 325,096 B), tiny
Llama (h64, F176, V128) B2 S64 2,024 B (``tests/estimate/test_adapter_forward.py``). Read for the layouts in
:data:`_DOWN` (a Llama MLP, GPT-NeoX's), a 16-bit or fp32 frozen base layer (not a 4-bit one), no adapter dropout,
the last block not checkpointed (a checkpointed block saves none of these and runs its forward with the cache off);
[] otherwise.
"""

from __future__ import annotations

import math

from trainmem.estimate.block_backward import block_items
from trainmem.estimate.phase import Phase
from trainmem.estimate.recompute_stop import _attention_output_held, _bytes
from trainmem.inventory import Category, Inventory, MemoryItem, dtype_bytes
from trainmem.names import is_embedding, is_embedding_indices, layer_of

__all__ = ["with_adapter_forward"]

#: a block's down projection and the up projection whose input is the MLP's input, by the MLP's layout
#: (transformers ``LlamaMLP.forward``, ``GPTNeoXMLP.forward``)
_DOWN = {"down_proj": "up_proj", "dense_4h_to_h": "dense_h_to_4h"}
#: a fused QKV projection, the attention's first (transformers ``GPTNeoXAttention.forward``): its input is the
#: block's normed input, nothing else of the attention exists yet
_FUSED_QKV: dict[str, str | None] = {"query_key_value": None}
#: the forward phase's parts made after the last block: the logits and their fp32 copy, the final hidden state the
#: output holds, the loss's padded labels (``estimate/forward_held.py``, ``estimate/peak.py``)
_LATER = ("logits", "head_input_unsaved", "padded_labels", "router_logits")


def with_adapter_forward(phases: list[Phase], items: Inventory, *, tokens: int, hidden: int, residual_dtype: str,
                         lora_dropout: float) -> list[Phase]:
    """``phases`` whose ``forward`` is the larger of the end of the forward and this moment (the module docstring),
    as the chunked losses' head moment is (estimate/peak.py), or a frozen 4-bit down projection's
    (:func:`_four_bit_down_moment`). ``tokens``: B·S; ``residual_dtype``: the residual stream's (and the embedding
    output's) dtype."""
    fwd = next((p for p in phases if p.name == "forward"), None)
    if fwd is None:
        return phases
    kw = dict(tokens=tokens, hidden=hidden, residual_dtype=residual_dtype)
    found = [(parts, note) for parts, note in (
        (_moment(fwd, items, **kw) if not lora_dropout else None,
         "inside the last block's adapted down (or fused QKV) projection, at lora_B's scaled output: the tensors "
         "saved so far, the base layer's output, peft's copy of its input, the block's and the model's locals"),
        (_four_bit_down_moment(fwd, items, **kw),
         "inside the last block's 4-bit down projection (Linear4bit): the tensors saved so far, the product and "
         "its compute-dtype cast, the dequantized weight and the matmul's output or its cast back, the block's "
         "and the model's locals")) if parts is not None]
    parts, note = max(found, key=lambda f: sum(f[0].values()), default=(None, ""))
    if parts is None or sum(parts.values()) <= fwd.bytes:
        return phases
    return [Phase("forward", sum(parts.values()), parts, note) if p is fwd else p for p in phases]


def _moment(fwd: Phase, items: Inventory, *, tokens: int, hidden: int, residual_dtype: str) -> dict[str, int] | None:
    """The larger of the last block's adapted down projection's moment and its fused QKV projection's."""
    found = [m for m in (_adapter_moment(fwd, items, "mlp", _DOWN, tokens=tokens, hidden=hidden,
                                         residual_dtype=residual_dtype),
                         _adapter_moment(fwd, items, "attention", _FUSED_QKV, tokens=tokens, hidden=hidden,
                                         residual_dtype=residual_dtype)) if m is not None]
    return max(found, key=lambda m: sum(m.values()), default=None)


def _adapter_moment(fwd: Phase, items: Inventory, scope: str, layers: dict[str, str | None], *, tokens: int,
                    hidden: int, residual_dtype: str) -> dict[str, int] | None:
    """At ``* scaling`` of the last block's adapted ``layers`` (a projection of ``scope`` -> the projection whose
    input is the scope's input, when that is another tensor: the MLP's up projection beside the down projection's
    product)."""
    saved = [i for i in items.base if i.category is Category.ACTIVATION and i.bytes]
    last = max((li for li in (layer_of(i.name) for i in saved) if li is not None), default=None)
    if last is None:
        return None
    block = block_items(items, last)
    sep = f".{scope}."
    marker = {i.name.split(sep, 1)[1].split(".", 1)[0]: i for i in block if i.category is Category.ACTIVATION
              and not i.bytes and sep in i.name and i.name.endswith(".input") and i.shape}
    # the projection's lora_A output, then (autocast) lora_B's weight copy: the block's last saved tensors before
    # its output sum (a checkpointed block saves neither)
    at = next((k for k, i in enumerate(saved) if layer_of(i.name) == last and sep in i.name
               and i.name.split(sep, 1)[1] in {f"{d}.lora_A.default.out" for d in layers}), None)
    if at is None:
        return None
    proj = saved[at].name.split(sep, 1)[1].split(".", 1)[0]
    adapter, lora_b = (next((i for i in block if i.category is Category.PARAMETER
                             and i.name.endswith(f"{sep}{proj}.lora_{ab}.default.weight")), None) for ab in "AB")
    prod = marker.get(proj)
    if adapter is None or lora_b is None or prod is None or not prod.note.startswith("not saved: frozen"):
        return None  # a trainable or 4-bit base layer: other tensors
    if scope == "attention" and "kv_cache_unsaved" in fwd.parts:
        return None  # the last block's cache copies are not made yet; the phase counts every block's
    at += 1 + (at + 1 < len(saved) and saved[at + 1].name.endswith(f"{sep}{proj}.lora_B.default.weight_cast"))
    block_saved = [i for i in saved[:at] if layer_of(i.name) == last]
    if any("/tp" in d or "/cp" in d for i in block_saved for d in i.dims):
        return None  # checked on one device
    autocast = any(i.name.endswith(".weight_cast") for i in block_saved)
    # in one dtype lora_A saves the layer's input and the scope's input themselves (peft's cast copies nothing)
    one_dtype = not autocast and adapter.dtype == prod.dtype
    up = marker.get(layers[proj]) if layers[proj] else None
    x = _bytes(up) if up is not None and not one_dtype else 0
    out = tokens * lora_b.shape[0]  # the layer's output features
    base = out * dtype_bytes(prod.dtype)  # the base layer's output
    lora_out = out * dtype_bytes(prod.dtype if autocast else adapter.dtype)  # autocast runs lora_B in the input's
    # peft's copy of the input in the adapter's dtype: saved by lora_A itself without autocast (then counted)
    copy = int(math.prod(prod.shape) * dtype_bytes(adapter.dtype)) if adapter.dtype != prod.dtype and not any(
        f"{sep}{proj}." in i.name and i.shape == prod.shape and i.dtype == adapter.dtype for i in block_saved) else 0
    # a parallel block's attention output, alive through its MLP (the residual's shape, the product's dtype)
    attn_out = tokens * hidden * dtype_bytes(prod.dtype) if scope == "mlp" and _attention_output_held(block_saved) else 0
    acts = [i for i in items.base if i.category is Category.ACTIVATION]
    found = {"block_locals": x + (0 if one_dtype else _bytes(prod)) + attn_out,
             "model_locals": _unsaved_embedding_output(acts, tokens * hidden * dtype_bytes(residual_dtype))
             + _cache_position(acts),
             "adapter_forward": base + copy + 2 * lora_out}
    parts = {k: v for k, v in fwd.parts.items() if k not in _LATER}
    parts["activations"] = parts.get("activations", 0) - sum(i.bytes for i in saved[at:])
    return {**parts, **{k: v for k, v in found.items() if v}}


def _four_bit_down_moment(fwd: Phase, items: Inventory, *, tokens: int, hidden: int,
                          residual_dtype: str) -> dict[str, int] | None:
    """The last block's frozen 4-bit down projection (bitsandbytes ``Linear4bit.forward``, no adapter on it) while it
    runs: ``x.to(compute_dtype)`` (a copy when the product's dtype differs), ``gemm_4bit`` (bitsandbytes
    ``backends/default/ops.py`` ``_gemm_4bit_default_impl``: the fp32 absmax when double quantized, the weight
    dequantized to the compute dtype, the output), then ``.to(inp_dtype)`` (a copy under a cast), the cast input held
    by the forward's local until it returns. Beside them: the tensors saved so far (the down projection saves
    none), the product and the MLP's input (saved by no 4-bit projection), the model's locals and what the forward
    phase holds to the loss. bitsandbytes' CUDA kernel (``backends/cuda/ops.py``) takes the same dequantize + linear
    path past 256 rows (B·S > 256); below, a fused kernel may make no dequantized weight. The fake-tensor trace
    runs ``gemm_4bit`` as one op and sees neither the absmax nor the
    dequantized weight (estimate/quant4bit_moments.py models the backward's, which is Python). None unless the last
    block's MLP is all bitsandbytes 4-bit with no adapter (estimate/quant4bit_moments.py ``four_bit_markers``)."""
    from trainmem.estimate.quant4bit import DEQUANTIZES_TO
    from trainmem.estimate.quant4bit_moments import COMPUTES_IN, four_bit_markers, four_bit_weight

    acts = [i for i in items.base if i.category is Category.ACTIVATION]
    last = max((li for li in (layer_of(i.name) for i in acts if i.bytes) if li is not None), default=None)
    if last is None:
        return None
    block = block_items(items, last)
    marker = four_bit_markers(block) or {}
    prod, x = marker.get("down_proj"), marker.get("up_proj")
    weight = next((i for i in block if i.category is Category.PARAMETER and i.name.endswith(".mlp.down_proj.weight")
                   and i.shape and DEQUANTIZES_TO in i.note), None)  # bitsandbytes' (torchao's linear_nf4 differs)
    # the MLP's last saved tensor (up's output, which MulBackward0 reads): what is saved after it comes later
    at = max((k for k, i in enumerate(acts) if i.bytes and layer_of(i.name) == last and ".mlp." in i.name), default=None)
    if None in (prod, x, weight, at):
        return None
    if any("/tp" in d or "/cp" in d for i in block for d in i.dims):
        return None  # checked on one device
    c = prod.note.rpartition(COMPUTES_IN)[2]
    out_c, out_a = tokens * hidden * dtype_bytes(c), tokens * hidden * dtype_bytes(prod.dtype)
    dequantized = four_bit_weight(block, weight, c)  # (the absmax, the weight in the compute dtype)
    cast = c != prod.dtype
    parts = {k: v for k, v in fwd.parts.items() if k not in _LATER and k != "dequant_temporary"}
    parts["activations"] = parts.get("activations", 0) - sum(i.bytes for i in acts[at + 1:])
    found = {"block_locals": _bytes(x) + _bytes(prod) + (int(math.prod(prod.shape) * dtype_bytes(c)) if cast else 0),
             "model_locals": _unsaved_embedding_output(acts, tokens * hidden * dtype_bytes(residual_dtype))
             + _cache_position(acts),
             "dequant_temporary": out_c + max(sum(dequantized), out_a if cast else 0)}
    return {**parts, **{k: v for k, v in found.items() if v}}


def _unsaved_embedding_output(acts: list[MemoryItem], nbytes: int) -> int:
    """``inputs_embeds`` (``nbytes``) when the embedding's scope keeps no output."""
    kept = any(i.bytes and layer_of(i.name) is None and is_embedding(i.name) and not is_embedding_indices(i.name)
               for i in acts)
    return 0 if kept else nbytes


def _cache_position(acts: list[MemoryItem]) -> int:
    """``cache_position`` (S int64), unless a node or a checkpoint keeps ``position_ids`` (its view). The token
    ids' marker gives S (a frozen embedding's ``indices``, (B, S))."""
    if any(i.bytes and i.name.endswith("position_ids") for i in acts):
        return 0
    ids = next((i for i in acts if is_embedding_indices(i.name) and i.shape and len(i.shape) == 2), None)
    return ids.shape[-1] * 8 if ids is not None else 0
