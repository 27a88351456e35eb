"""The MLP moments of a fine-tuned checkpointed compiled block's backward (``--finetune lora|qlora --compile
--compile-scope block|block-loss --recompute full``), read off the block's eager saved set.

Fine-tuning under compile is modelled with full recompute only (``rules_compiled.py``: a compiled block with
frozen weights and adapters is not read without checkpointing), so the set a checkpointed block recomputes is
the eager one (``estimate/__init__.py``: ``plain`` without compile). That is also what the compiled backward
holds: its graph runs the ``tag_activation_checkpoint`` region again, every recomputed value the backward
reads is held until that read (``torch/_functorch/partitioners.py`` ``must_recompute``; each value freed
after its last use by the boxed calling convention, ``torch/_functorch/_aot_autograd/runtime_wrappers.py``),
and what the backward reads is what eager autograd saves: the norms' fp32 inputs and rsqrt, the adapters'
``lora_A`` outputs (``lora_B``'s weight gradient reads them) and their input (``lora_A``'s), the attention's
q, k, v, output and log-sum-exp, and only what a trainable weight's gradient needs (a frozen norm's
normalized product, a frozen gate/up's input are not held). Two MLP moments are modelled beside the residual
stream's gradient, as for the compiled set without fine-tuning (``estimate/compiled_recompute.py``), on
inductor's decompositions (``torch/_inductor/decomposition.py`` ``select_decomp_table``):

* the product ``silu(gate)·up``: down_proj's input gradient and ``grad·up`` (2·B·S·F in the MLP's dtype)
  while ``silu(gate)``, ``up`` and the gate (16-bit: its fp32 copy, ``pw_cast_for_opmath`` in
  ``torch/_prims_common/wrappers.py``) are held; down_proj's items (its input, adapter output) are freed;
* SiLU's backward: up_proj's input gradient (B·S·H) and ``silu_backward``'s three fp32 B·S·F temporaries
  (the upcast gradient, ``sigmoid(gate)`` and their product), ``silu(gate)``, ``up`` and up_proj's items
  freed, the gate's fp32 copy held.

The block's input: a 16-bit one is freed once the input norm's fp32 copy exists, a fp32 one is that norm's
input itself; but a first block's input under fine-tuning is the frozen embedding's output, which
``enable_input_require_grads`` (``transformers/modeling_utils.py``, called by ``gradient_checkpointing_enable``)
makes a leaf that requires grad, and the graph's ``AccumulateGrad`` node holds a leaf itself
(``torch/csrc/autograd/functions/accumulate_grad.h``: its ``variable``), so it stays. The same leaf means the
first block recomputes what a later block with the same trainable weights saves (its input requires grad),
not its own eager set, taken without checkpointing where a frozen embedding's output requires no grad (no
input norm tensors, nor the attention's with adapters on the MLP only).

QLoRA (torchao NF4, the only 4-bit base compiled): the recompute dequantizes each 4-bit weight for its forward
and the backward's input-gradient mm reads that weight again, so every 4-bit weight whose mm is still to run is
held (``_four_bit``); and the adapters' casts of one input to their dtype are one tensor in the compiled graph.

Tiny Llama (H 64, F 176, 4/2 heads, V 256, untied), B 2, S 64, AdamW, block-loss, full recompute: estimate =
trace less the caller's token ids (1024 B, not saved by a frozen embedding, not counted), LoRA q/v r 8 bf16
827,592 B (block 0's SiLU backward; 0.889 before) and fp32 1,276,232 B (block 1's product; 0.954), fp16, LoRA on
every linear (0.857 before) and full fine-tuning with a frozen embedding; QLoRA q/v/gate (H 256, F 512, 4 heads)
bf16: 4,192,644 B = both SiLU moments of the trace, whose peak (4,849,028 B) is torchao's dequantization run
unfused (int64 codes), which the compiled rule counts as the weight alone (``finetune.dequant_transient``)
(``tests/estimate/test_compiled_finetune_moment.py``).

Under autocast (amp-bf16) eager autograd saves each linear's bf16 input cast and the compiled graph one per
input (``_held_now``); the bf16 weight copies are held until their linear's input-gradient mm: LoRA q/v
1,199,944 B = trace less the ids (0.900 before). Read on the eager set without fine-tuning, both moments equal
``compiled_recompute.py``'s on the compiled set in fp32, bf16, fp16 and amp-bf16.

Known limitations: only a Llama-style block is read, with the activations of ``compiled_recompute._ACTIVATIONS``
(Gemma's GELU-tanh and norm read off its eager set equal the compiled set's reading, though compiled Gemma
refuses fine-tuning for now); the attention's and norms' backward
moments are not modelled (lower where traced); one device only (``peak.phases`` gets the flag from
``estimate/__init__.py`` alone).
"""

from __future__ import annotations

import math

from trainmem.estimate.block_backward import block_items
from trainmem.estimate.compiled_block_moment import block_grads
from trainmem.inventory import Category, Inventory, MemoryItem, dtype_bytes
from trainmem.names import as_block, is_token_embedding, split_block

__all__ = ["finetune_checkpoint_moments"]

_FP32 = dtype_bytes("float32")
_ACT, _PROD = "mlp.act_fn.out", "mlp.act_mul_up"
# a linear's output as the eager rules name it: plain, or an adapted one's (estimate/finetune.py: the adapter's sum,
# then its cast back to the base's dtype, which is the sum itself when the dtypes agree)
_LINEAR_OUT = ("out", "lora_out", "lora_sum")
_NORM2 = "post_attention_layernorm"
_OUT = "residual_mlp"  # the block's output: the next block's input, which no node of this block reads
# the linears that read one input (the input norm's output, the post-attention norm's)
_SHARED_INPUT = {**dict.fromkeys(("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), "attention"),
                 **dict.fromkeys(("mlp.gate_proj", "mlp.up_proj"), "mlp")}


def finetune_checkpoint_moments(items: "Inventory | list[MemoryItem]", last: int, residual_bytes: int,
                                recomputed: "Inventory | list[MemoryItem]", *, act_held: int,
                                act_work: int) -> list[dict[str, int]]:
    """The product's and SiLU's moments of block ``last``'s backward (dicts as ``compiled_checkpoint_moments``
    returns) when ``recomputed`` is the eager saved set of a fine-tuned compiled Llama block, empty
    otherwise. ``act_held``/``act_work``: the activation's fp32 B·S·F values held by the recompute in place
    of the gate and written at once by its backward (``compiled_recompute._ACTIVATIONS``)."""
    eager = _acts(recomputed, last)
    held = _recomputed_set(items, recomputed, last)
    gate, up = (_linear_out(held or {}, c) for c in ("gate_proj", "up_proj"))
    if held is None or gate is None or up is None or any(n not in held for n in (_ACT, f"{_NORM2}.rsqrt")):
        return []
    wide = held.get(f"{_NORM2}.x_fp32") or held.get("residual_attn")  # the norm's fp32 input (B, S, H)
    if wide is None:
        return []
    tokens = held[f"{_NORM2}.rsqrt"].bytes // _FP32  # B·S
    x = residual_bytes // (tokens * wide.shape[-1])  # the residual stream's dtype
    first, leaf = last == min(_layers(recomputed)), _frozen_embedding(items)
    # the kept input (the previous block's output or the embedding's): freed in 16-bit (its fp32 copy is the
    # norm's input) unless it is the leaf enable_input_require_grads made; in fp32 it is the norm's input
    block_input = residual_bytes if x < _FP32 and not (first and leaf) else 0
    # what peak.phases added for this block (the eager set and the kept output it lacks) is taken off whole
    kept = [i for i in block_items(items, last) if i.category is Category.ACTIVATION]
    names = {i.name for i in eager}
    freed = sum(i.bytes for i in eager) + sum(i.bytes for i in kept if i.name not in names) + block_input
    grads = block_grads(block_items(items, last))
    gate32 = gate.bytes // dtype_bytes(gate.dtype) * _FP32  # B·S·F in fp32
    residual, up_dx = residual_bytes, tokens * wide.shape[-1] * x
    weights = _four_bit(items, last, dtype_bytes(gate.dtype))
    out = []
    for gone, g, work in (
            # down_proj's input gradient and grad·up while silu(gate), up and the gate are held
            (("mlp.down_proj.", _PROD), grads["down_proj"], residual + 2 * up.bytes),
            # up_proj's input gradient, then silu_backward's fp32 temporaries; silu(gate) and up were freed
            (("mlp.down_proj.", _PROD, "mlp.up_proj.", _ACT), grads["down_proj"] + grads["up_proj"],
             residual + up_dx + act_work * gate32)):
        # the recomputed values still held: the gate as the activation's fp32 values, the block output not at all;
        # QLoRA: each 4-bit weight dequantized by the recompute until its input-gradient mm, less the one
        # dequantized weight finetune.with_dequant_transient adds to the phase (the largest block weight's)
        dequant = sum(b for n, b in weights.items() if not n.startswith(gone)) - max(weights.values(), default=0)
        out.append({"block_gradients": g, "new_gradients": g, "freed_activations": freed, "after_attention": 0,
                    "work": work + _held_now(held, gone, gate) + act_held * gate32 + dequant})
    return out


def _held_now(held: dict[str, MemoryItem], gone: tuple[str, ...], gate: MemoryItem) -> int:
    """The recomputed values still held once the items under ``gone`` were read: not the gate (held as its fp32
    copy) nor the block's output. The casts of one input to one dtype (autocast's per linear, peft's
    ``_cast_input_dtype`` to the adapters' dtype) are one tensor in the compiled graph (``torch/_functorch/
    partitioners.py`` runs ``fx_graph_cse``, ``torch/_functorch/compile_utils.py``) where eager autograd saves each
    linear's: held while any reader waits. Autocast's weight copies go with their linear's items."""
    casts: dict[str, int] = {}
    total = 0
    for n, i in held.items():
        if i is gate or n == _OUT or n.startswith(gone):
            continue
        linear = ".".join(n.split(".")[:2])  # self_attn.q_proj for its adapter's cast too
        if n.endswith("input_cast") and linear in _SHARED_INPUT:  # autocast's (input_cast), peft's (lora_...)
            casts[f"{_SHARED_INPUT[linear]} {i.dtype}"] = i.bytes
        else:
            total += i.bytes
    return total + sum(casts.values())


def _four_bit(items: "Inventory | list[MemoryItem]", last: int, b: int) -> dict[str, int]:
    """Block ``last``'s 4-bit weights (QLoRA, torchao NF4: ``nf4`` items) dequantized to ``b`` bytes an element,
    by path inside the block: the checkpoint's recompute dequantizes each (``NF4Tensor``'s ``linear``) and the
    backward's input-gradient mm reads that weight again, so it is held from the recompute to that mm."""
    return {_inner(i.name): math.prod(i.shape) * b for i in block_items(items, last)
            if i.category is Category.PARAMETER and i.dtype == "nf4" and i.shape}


def _recomputed_set(items: "Inventory | list[MemoryItem]", recomputed: "Inventory | list[MemoryItem]",
                    last: int) -> dict[str, MemoryItem] | None:
    """The eager set block ``last`` recomputes, by its path inside the block: its own, or for a first block
    whose input is the frozen embedding's leaf, the next block's when the two train the same weights (its
    input requires grad as the leaf does; None when there is no such block)."""
    layers = _layers(recomputed)
    if last != min(layers) or not _frozen_embedding(items):
        return {_inner(i.name): i for i in _acts(recomputed, last)}
    nxt = last + 1
    if nxt not in layers or _trained(items, last) != _trained(items, nxt):
        return None
    return {_inner(i.name): i for i in _acts(recomputed, nxt)}


def _linear_out(held: dict[str, MemoryItem], linear: str) -> MemoryItem | None:
    """The MLP linear's output its consumer saved (``mlp.gate_proj.out``, an adapted one's ``lora_out``/``lora_sum``)."""
    return next((held[n] for k in _LINEAR_OUT if (n := f"mlp.{linear}.{k}") in held), None)


def _trained(items: "Inventory | list[MemoryItem]", layer: int) -> set[str]:
    """Block ``layer``'s gradient names, as block 0's."""
    return {as_block(i.name) for i in block_items(items, layer) if i.category is Category.GRADIENT}


def _frozen_embedding(items: "Inventory | list[MemoryItem]") -> bool:
    """The token embedding has no gradient: under checkpointing its output is the leaf ``enable_input_require_grads``
    makes (``estimate/rules_hf_parts.py`` ``_embedding``)."""
    inv = items if isinstance(items, Inventory) else Inventory(items)
    return not any(i.category is Category.GRADIENT and is_token_embedding(i.name) for i in inv.base)


def _acts(inv: "Inventory | list[MemoryItem]", layer: int) -> list[MemoryItem]:
    return [i for i in block_items(inv, layer) if i.category is Category.ACTIVATION]


def _layers(inv: "Inventory | list[MemoryItem]") -> set[int]:
    inv = inv if isinstance(inv, Inventory) else Inventory(inv)
    return {p[1] for i in inv.base if (p := split_block(i.name))} | {d for r in inv.repeats for d in (r.src, *r.dsts)}


def _inner(name: str) -> str:
    parts = split_block(name)
    return parts[2] if parts else name
