"""The moments inside a checkpointed compiled block's backward (``--compile`` per block, ``--recompute full``).

A block compiled around its checkpoint keeps only its input (``rules_compiled.py`` ``_checkpointed_block``; whole-model
compile: ``_checkpointed_layers``).
Its backward graph first runs the ``tag_activation_checkpoint`` region again (the partitioner must
recompute those nodes: ``torch/_functorch/partitioners.py`` ``must_recompute``, ``min_cut_rematerialization_partition``)
and then the block's backward, op by op on inductor's decompositions (``torch/_inductor/decomposition.py``
``select_decomp_table``), each value freed after its last use (the boxed calling convention,
``torch/_functorch/_aot_autograd/runtime_wrappers.py``). Unlike the region without checkpointing, whose
min-cut recomputes cheap pointwise values from a small saved set, here every forward value the
backward reads is recomputed and held until that read: what eager autograd would save, not the compiled
saved set. From the compiled saved set ``C`` of the block (the inventory without checkpointing), that is

* each RMSNorm's input in fp32 (``x.to(float32)``, B·S·H·4: the decomposed norm backward reads it; a
  16-bit input is freed once its fp32 copy exists, so the checkpoint's kept input is freed too) and its
  normalized product ``x·rsqrt`` in the input's dtype (``LlamaRMSNorm`` casts it back before the weight;
  the weight gradient reads it); the attention's residual sum replaces ``o_proj``'s output, which it frees;
* SwiGLU's ``silu(gate)`` (B·S·F), which the product's backward reads; under a 16-bit dtype the gate as
  the fp32 copy ``silu``'s decomposition makes (``pw_cast_for_opmath``), its 16-bit output freed;
* under autocast (amp-bf16: the residual stream fp32, what the linears make bf16) the bf16 weight copies
  of the compiled set, each until its linear's input-gradient mm (down_proj's, then up_proj's, before
  the moments below); the residual gradient and up_proj's input gradient (cast back) are in fp32.

Two moments of the MLP's backward, both beside the residual stream's gradient (B·S·H), are modelled
(:func:`compiled_checkpoint_moments`); the larger one, or the block's working set
(``estimate/peak.py``), is the phase:

* the product ``silu(gate)·up`` (``mul.Tensor``, two ``mul`` nodes): down_proj's weight gradient, the
  product's gradient (B·S·F) and ``grad·up``, while ``silu(gate)`` and ``up`` are held (``silu(gate)`` is
  freed before ``grad·silu(gate)``: 2·B·S·F of work, not eager's 3);
* SiLU's backward (``silu_backward`` decomposed in fp32: the upcast gradient, ``sigmoid(gate)`` and
  their product, 3·B·S·F·4): down_proj's and up_proj's weight gradients and up_proj's input gradient
  (B·S·H) exist, ``silu(gate)``, ``up`` and the product were freed.

Whole-model compile (one region around every checkpointed block) holds more beside them (:func:`_one_region_held`).

Checked against the trace (``trace/compiled.py``: the same partitioned graphs run op by op, no fusion)
for a tiny and a wider Llama, fp32, bf16, fp16 and amp-bf16, per block and whole-model, on one device
(``tests/estimate/test_compiled_recompute.py``) and under FSDP2 and HSDP (``test_compiled_fsdp.py``,
``test_compiled_hsdp.py``).

Known limitations:
  - These are the unfused graphs' moments (the trace's), not inductor's. Inductor fuses the pointwise
    chains (no fp32 temporary of SiLU's backward, no normalized product) but its fused MLP-backward
    kernel writes the product, ``grad·silu(gate)`` and the SiLU gradient at once: a real CPU step of the
    tiny Llama above peaked 12,288 B above the trace in fp32 and 200,716 B below it in bf16
    (docs/compile.md, "Per-block compilation"). Neither is a bound on the other.
  - Only the Llama block's compiled set is read (two RMSNorms, a gated MLP; no Float8, q/k norms, sandwich
    norms, fused projections or experts): anything else returns no moment, and the block's working set
    alone stands (as before). The activation's values are SiLU's or Gemma's GELU-tanh's (``_ACTIVATIONS``,
    with Gemma's RMSNorm: tiny Gemma, MQA, V 128, tied, B 2 S 64, estimate == trace 1,516,362 B bf16 and
    2,458,700 B fp32, where SiLU's counts read 0.859 and 0.890; a wider one, H 128 F 352 3 blocks, bf16
    B 1 S 96 MQA: 5,376,650 B, fp16 B 2 S 32 with 2 K/V heads: 5,166,730 B, both exact). ``ModelSpec.activation``
    "geglu" also stands for an erf GELU (a Llama with ``hidden_act="gelu"``), which holds one fp32 B·S·F less:
    tiny Llama bf16 B 2 S 64 estimate 1,683,784 B, trace 1,593,672 B (90,112 B over; Gemma's "gelu" is tanh).
    ``peak.phases`` passes :func:`block_math` on as its ``block_math``, from the one-device estimate only
    (estimate/__init__.py); under FSDP2 a Gemma block reads SiLU's counts.
  - Fine-tuning (LoRA, QLoRA, frozen parameters) under compile reads the eager set as its recomputed one
    (estimate/__init__.py): its moments are read off that set (``eager_set``, estimate/compiled_finetune_moment.py).
  - The attention's and the norms' backward moments are not modelled (lower than the MLP's where traced).
"""

from __future__ import annotations

from trainmem.estimate.block_backward import block_items
from trainmem.estimate.compiled_block_moment import block_grads, cache_tangents, uncheckpointed_moments
from trainmem.estimate.compiled_finetune_moment import finetune_checkpoint_moments
from trainmem.estimate.compiled_float8_moment import float8_uncheckpointed_moments, is_float8_block
from trainmem.estimate.compiled_float8_recompute import float8_checkpoint_moments
from trainmem.estimate.compiled_op_moment import op_block_freed, uncast_linears
from trainmem.inventory import Category, Inventory, MemoryItem, dtype_bytes
from trainmem.names import layer_of, split_block

__all__ = ["block_math", "compiled_checkpoint_moments"]

_NORMS = ("input_layernorm", "post_attention_layernorm")
_MLP = ("mlp.gate_proj.out", "mlp.up_proj.out", "mlp.act_mul_up")
_REQUIRED = (*(f"{n}.{p}" for n in _NORMS for p in ("rsqrt", "out")), "self_attn.o_proj.out", *_MLP)
_OTHER_SELF_ATTN = ("norm", "scale", "q_proj.out", "k_proj.out")  # q/k norms and their inputs, Float8 scales
_LINEARS = ("gate_proj", "up_proj", "down_proj")  # the MLP's, whose autocast weight copies may be kept
_FP32 = dtype_bytes("float32")
# per gated MLP activation (ModelSpec.activation): how many fp32 B·S·F values its recomputed forward holds
# for its backward (in place of the compiled set's gate) and how many its decomposed backward writes at once
_ACTIVATIONS = {
    # silu's decomposition upcasts the gate (torch/_prims_common/wrappers.py pw_cast_for_opmath: one fp32 copy,
    # the gate itself in fp32); silu_backward: the upcast gradient, sigmoid(gate) and their product
    "swiglu": (1, 3),
    # Gemma's GELU-tanh (torch/_refs/nn/functional gelu, approximate="tanh"): x/2, the tanh's input, tanh and
    # 1 + tanh are held, the gate's fp32 copy freed; gelu_backward (torch/_decomp/decompositions.py): the upcast
    # gradient and one product at a time (read off the trace of a tiny Gemma; an erf GeGLU is not checked)
    "geglu": (4, 2),
}
_ROOT = "model"  # the decoder's module path, where whole-model compile's rules keep the causal mask


def compiled_checkpoint_moments(items: "Inventory | list[MemoryItem]", last: int, residual_bytes: int,
                                recomputed: "Inventory | None" = None, *, activation: str = "swiglu",
                                unit_offset_norm: bool = False, eager_set: bool = False,
                                uncheckpointed: bool = False, one_graph: bool = False) -> list[dict[str, int]]:
    """The two MLP moments of block ``last``'s backward when it is a checkpointed compiled Llama block
    whose compiled saved set (without checkpointing) is ``recomputed``; empty otherwise. Each moment is a
    dict as ``block_backward.norm_backward_parts`` returns: ``block_gradients`` (and ``new_gradients``:
    the compiled backward returns its weight gradients as new tensors, beside a stored ``.grad``),
    ``freed_activations`` (of the recomputed set and the checkpoint's kept input), ``after_attention``
    and ``work``: the residual stream's gradient, the op's temporaries and what the recomputation holds
    beyond the compiled set (see the module docstring). ``activation``: the gated MLP's (``_ACTIVATIONS``; any
    other gets no moment); ``unit_offset_norm``: Gemma's RMSNorm, which holds its normalized product in fp32
    and ``1 + weight`` (fp32, H) for its backward (``GemmaRMSNorm.forward``: the weight applied before the cast).
    ``eager_set``: the blocks are compiled and ``recomputed`` is their eager set (fine-tuning:
    estimate/compiled_finetune_moment.py). Without
    ``recomputed`` (no checkpointing) and with ``uncheckpointed`` (one device, where it is checked), a compiled
    Llama block's own moments (estimate/compiled_block_moment.py; ``one_graph``: whole-model compile, one
    backward graph for every block)."""
    if recomputed is None:
        if not uncheckpointed:
            return []
        own = {_inner(i.name): i for i in block_items(items, last) if i.category is Category.ACTIVATION}
        if activation == "swiglu" and not unit_offset_norm and is_float8_block(own):  # compiled_float8_moment.py
            return float8_uncheckpointed_moments(own, block_grads(block_items(items, last)), residual_bytes,
                                                 tangents=cache_tangents(items, (last,)))
        if activation != "swiglu" or unit_offset_norm or not _llama_compiled(own) or "self_attn.k_rope" not in own:
            return []  # the cache tangents are the roped k and v (a layout without them: not checked)
        # one graph: the cache tangents of every block up to this one (the later ones' were read by their attention)
        tangents = cache_tangents(items, range(last + 1) if one_graph else (last,))
        return uncheckpointed_moments(own, block_grads(block_items(items, last)), residual_bytes, tangents=tangents)
    if activation not in _ACTIVATIONS:
        return []
    if eager_set:  # the eager set holds Gemma's fp32 normalized product and 1 + weight itself
        return finetune_checkpoint_moments(items, last, residual_bytes, recomputed,
                                           act_held=_ACTIVATIONS[activation][0], act_work=_ACTIVATIONS[activation][1])
    kept = {_inner(i.name): i for i in block_items(recomputed, last) if i.category is Category.ACTIVATION}
    if not _llama_compiled(kept):  # Float8's set recomputes the converted linears' inputs: its own moment
        return float8_checkpoint_moments(items, last, residual_bytes, recomputed) if activation == "swiglu" else []
    gate, up, prod = (kept[n] for n in _MLP)
    a = dtype_bytes(gate.dtype)  # what the linears make (autocast: 16-bit beside a fp32 residual stream)
    outs = [kept[f"{n}.out"] for n in _NORMS]
    # the block's output, the next block's input: freed by its backward (the last block's is the final norm's)
    after = kept.get("residual_mlp")
    if any(o.dtype != gate.dtype for o in outs):
        return []
    tokens_h, gate_numel = outs[0].bytes // a, gate.bytes // a  # B·S·H, B·S·F
    x = residual_bytes // tokens_h  # the residual stream's dtype: the block's input, the norms' products
    act_held, act_work = _ACTIVATIONS[activation]
    # what the recomputation holds beyond the compiled set: each norm's fp32 input and normalized
    # product (in the input's dtype: Llama casts it back before the weight; Gemma's in fp32, with its fp32
    # 1 + weight), the activation's output and its fp32 values in place of the gate (SiLU: the 16-bit gate's
    # fp32 copy); o_proj's output is freed by the residual sum
    norm = 2 * tokens_h * _FP32 + outs[0].shape[-1] * _FP32 if unit_offset_norm else tokens_h * (_FP32 + x)
    held = (len(outs) * norm + gate.bytes + gate_numel * (act_held * _FP32 - a)
            - kept["self_attn.o_proj.out"].bytes + _one_region_held(items, kept, last, a))
    # the checkpoint's kept input: a fp32 one is the input norm's (counted in ``held``), a 16-bit one is freed;
    # the residual stream's gradient and up_proj's input gradient (autocast's cast backward: in x) are x too
    block_input = residual = up_dx = tokens_h * x
    # autocast's weight copies are freed by their linear's input-gradient mm, down_proj's first, then up_proj's
    # (under op-level checkpointing a kept mm's copy is not made before these moments: op_block_freed counts it)
    uncast = uncast_linears(items, last, kept)
    copies = {c: getattr(kept.get(f"mlp.{c}.weight_cast"), "bytes", 0) if f"mlp.{c}" not in uncast else 0
              for c in ("down_proj", "up_proj")}
    freed = prod.bytes + (after.bytes if after is not None else 0) + block_input + copies["down_proj"]
    freed += op_block_freed(items, last, kept, norm, block_input)  # --recompute op: compiled_op_moment.py
    grads = block_grads(block_items(items, last))
    product = {"block_gradients": grads["down_proj"], "new_gradients": grads["down_proj"],
               "freed_activations": freed, "after_attention": 0,
               "work": residual + 2 * prod.bytes + held}
    silu = {"block_gradients": grads["down_proj"] + grads["up_proj"],
            "new_gradients": grads["down_proj"] + grads["up_proj"],
            "freed_activations": freed + up.bytes + copies["up_proj"], "after_attention": 0,
            # up_proj's input gradient, then the activation's backward temporaries; its output was freed
            "work": residual + up_dx + act_work * gate_numel * _FP32 + held - gate.bytes}
    return [product, silu]


def block_math(model, *, eager_set: bool = False, one_graph: bool = False) -> dict:
    """What :func:`compiled_checkpoint_moments` reads of the model beyond the inventory (``peak.phases``'s
    ``block_math``, from the one-device estimate): the gated MLP's activation, whether its RMSNorm is Gemma's
    (``Rules.unit_offset_norm``), whether the recomputed set of a compiled block is the eager one (``eager_set``:
    fine-tuning), whether one graph holds every block (``one_graph``: whole-model compile), and that a block
    compiled without checkpointing gets its own moments (``uncheckpointed``: checked on one device)."""
    from trainmem.families import family_of
    return {"activation": model.activation, "unit_offset_norm": family_of(model).rules.unit_offset_norm,
            "eager_set": eager_set, "uncheckpointed": True, "one_graph": one_graph}


def _one_region_held(items: "Inventory | list[MemoryItem]", kept: dict[str, MemoryItem], last: int, a: int) -> int:
    """What whole-model compile (one region around every checkpointed block: its materialized causal mask is
    kept, ``rules_compiled.py`` ``_checkpointed_layers``) holds beside a block's recomputed set, 0 per block:

    * the rotary cos and sin (1, S, hd), recomputed once when the region's backward starts and read by
      every block's recompute (per block they are eager inputs, kept: ``model.rotary_emb``);
    * with grouped K/V heads, ``repeat_kv``'s expanded K and V (B, A, S, hd) instead of the recomputed
      k and v: the SDPA call gets the mask, so transformers expands the heads (``use_gqa_in_sdpa`` is
      false with a mask; per block ``is_causal`` and ``enable_gqa``);
    * once a later block ran its attention backward, the zero-filled q- and k-shaped buffers of the
      rotary ``cat``'s backward (``slice_backward`` decomposed to ``full`` + ``slice_scatter``): one
      graph, so the partition's constants are shared by the blocks and live until the first block's
      (one buffer when q and k have the same shape: without grouped K/V heads).

    Read off the trace of the tiny Llama (fp32 90,112 B, bf16 45,056 B at the first block's moment) and
    checked on a wider one with and without grouped heads (tests/estimate/test_compiled_recompute.py)."""
    inv = items if isinstance(items, Inventory) else Inventory(items)
    lse, q, k = kept.get("self_attn.lse"), kept["self_attn.q_rope"], kept["self_attn.k_rope"]
    if lse is None or not any(i.name == f"{_ROOT}.causal_mask" for i in inv.base):
        return 0
    heads = lse.shape[1]  # the CPU SDPA's logsumexp: (B, A, S)
    seq, hd = q.shape[1], q.shape[-1] // heads
    cos_sin = 2 * seq * hd * a
    expanded = 2 * (q.bytes - k.bytes)  # K and V at A heads, less k and v at Akv (0 without grouped heads)
    later = any(d > last for r in inv.repeats for d in (r.src, *r.dsts)) or any(
        (layer_of(i.name) or -1) > last for i in inv.base)
    zeros = q.bytes + (k.bytes if k.shape != q.shape else 0)  # equal shapes: one constant (no grouped heads)
    return cos_sin + expanded + (zeros if later else 0)


def _inner(name: str) -> str:
    """The path inside the block (``mlp.up_proj.out``), or the name outside blocks."""
    parts = split_block(name)
    return parts[2] if parts else name


def _llama_compiled(kept: dict[str, MemoryItem]) -> bool:
    """The Llama block's compiled set: its two norms' rsqrt and output, the attention's kept tensors,
    o_proj's output, gate, up and their product, and nothing else (the block output aside)."""
    if any(n not in kept for n in _REQUIRED):
        return False
    extra = set(kept) - set(_REQUIRED) - {"residual_mlp"} - {f"mlp.{c}.weight_cast" for c in _LINEARS}
    return all(n.startswith("self_attn.") and not any(k in n for k in _OTHER_SELF_ATTN) for n in extra)
