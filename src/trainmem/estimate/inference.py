"""Inference memory: weights, the prefill working set, and the KV cache (GQA/MQA, paged).

No autograd: a forward frees each intermediate once its consumer has run, so the activation peak is
one block's live set, not the sum over blocks. The live set is modelled from the training saved set
of one block in execution order (the inventory's order): the residual stream, plus the largest
three consecutive tensors (an op's inputs and its output; e.g. gate, up and act·up in a SwiGLU MLP,
or the fp32 scores and bf16 probabilities of eager attention).

KV cache (vLLM's paged attention, Kwon et al. 2023, §4.1: memory in fixed blocks of tokens)::

    2 (K and V) · layers · batch · ⌈context / block⌉·block · kv_heads · head_dim · dtype_bytes

Phases: ``prefill`` (weights + cache + one block's live set), ``prefill_logits`` (weights + cache +
the logits: the last position's only, in fp32, unless ``all_logits``), ``decode`` (weights + cache +
one token's live set, negligible).

Known limitations:
  - No sliding-window or cross-layer cache sharing, no MLA, no quantized caches (the cache dtype is
    the activation dtype); encoders have no cache.
  - The prefill live set is an upper-bound heuristic from the saved set, not a trace.
"""

from __future__ import annotations

from dataclasses import replace

from trainmem.errors import SpecError
from trainmem.estimate import Estimate
from trainmem.estimate.activations import activation_items
from trainmem.estimate.model_states import model_state_items
from trainmem.estimate.peak import Phase, layer_of
from trainmem.estimate.symbols import formula
from trainmem.inventory import Category, Inventory, MemoryItem, dtype_bytes
from trainmem.specs import ImplSpec, ModelSpec, StepSpec

__all__ = ["inference_estimate", "kv_cache_bytes"]


def _cache_dtype(step: StepSpec) -> str:
    d = step.dtypes
    return d.activation if d.autocast else d.param


def kv_cache_bytes(model: ModelSpec, *, batch: int, context: int, dtype: str = "bfloat16", block_size: int = 1) -> int:
    """2 · L · B · ⌈context/block⌉·block · kv_heads · head_dim · dtype_bytes (0 for encoders)."""
    if model.arch != "decoder":
        return 0
    tokens = -(-context // block_size) * block_size
    return int(2 * model.num_layers * batch * tokens * model.num_kv_heads * model.head_dim * dtype_bytes(dtype))


def _block_live_set(items: list[MemoryItem], layer: int) -> tuple[int, list[str]]:
    """Largest sum of three consecutive saved tensors of block ``layer`` (execution order)."""
    block = [it for it in items if layer_of(it.name) == layer]
    best, names = 0, []
    for i in range(len(block)):
        window = block[i:i + 3]
        total = sum(it.bytes for it in window)
        if total > best:
            best, names = total, [it.name for it in window]
    return best, names


def inference_estimate(model: ModelSpec, step: StepSpec, impl: ImplSpec | None = None, *, context: int,
                       block_size: int = 16, all_logits: bool = False) -> Estimate:
    """Memory of serving ``model``: ``step.batch`` sequences, a prompt of ``step.seq`` tokens and a
    cache of ``context`` tokens each (prompt + generated), in pages of ``block_size`` tokens."""
    impl = impl or ImplSpec()
    if isinstance(context, bool) or not isinstance(context, int) or context <= 0:
        raise SpecError("context", context, "must be a positive integer")
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size <= 0:
        raise SpecError("block_size", block_size, "must be a positive integer")
    if step.dtypes.gathered:
        raise SpecError("precision", step.precision, "is FSDP2's training recipe; serve the weights as bf16")
    if context < step.seq and model.arch == "decoder":
        raise SpecError("context", context, f"must be at least the prompt length seq={step.seq}")
    step = replace(step, mode="inference", grad_accum=1)
    B, L = step.batch, model.num_layers
    weights = model_state_items(model, step)  # parameters only in inference mode
    dt = _cache_dtype(step)
    rounded = -(-context // block_size) * block_size
    cache: list[MemoryItem] = []
    if model.arch == "decoder":
        shape = (2, B, model.num_kv_heads, rounded, model.head_dim)
        per_layer = kv_cache_bytes(model, batch=B, context=context, dtype=dt, block_size=block_size) // L
        prefix = "transformer.h" if model.family == "gpt2" else "model.layers"
        dims = ("2", "B", "Akv", f"⌈ctx/{block_size}⌉·{block_size}", "hd")
        text = formula(dims, dtype_bytes(dt))
        for i in range(L):
            cache.append(MemoryItem.make(f"{prefix}.{i}.self_attn.kv_cache", Category.KV_CACHE, shape, dt,
                                         per_layer, text, dims))
    acts = activation_items(model, replace(step, mode="train"), replace(impl, recompute="none", recompute_every=1))
    live, names = _block_live_set(acts, 0)
    resid = int(B * step.seq * model.hidden_size * dtype_bytes(dt))
    rows = B * step.seq if all_logits else B
    logits = int(rows * model.vocab_size * 4)
    P = sum(it.bytes for it in weights)
    K = sum(it.bytes for it in cache)
    decode_live = int(B * max(model.hidden_size, model.ffn_size) * 3 * dtype_bytes(dt))
    phases = (
        Phase("prefill", P + K + resid + live, {"parameters": P, "kv_cache": K, "residual": resid, "block_live": live},
              f"one block's forward over the prompt: residual stream + {', '.join(n.rsplit('.', 2)[-2] + '.' + n.rsplit('.', 1)[-1] for n in names)}"),
        Phase("prefill_logits", P + K + logits, {"parameters": P, "kv_cache": K, "logits": logits},
              f"fp32 logits of {'every prompt position' if all_logits else 'the last position'} (B·{'S·' if all_logits else ''}V·4)"),
        Phase("decode", P + K + decode_live, {"parameters": P, "kv_cache": K, "token_live": decode_live},
              "one generated token: the cache dominates"),
    )
    return Estimate(model, step, impl, Inventory(tuple(weights) + tuple(cache)), phases)
