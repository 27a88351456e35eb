"""The MLP moments of a compiled Llama block's backward with torchao's Float8 tensorwise and no checkpointing
(``--float8 tensorwise --compile --compile-scope block --recompute none``).

The block's compiled saved set (``rules_compiled.py`` with ``estimate/float8.py`` ``compiled_input_recomputed`` and
``compiled_scales``) lacks the converted linears' high-precision inputs: the partitioned backward
(``torch/_functorch/partitioners.py`` ``min_cut_rematerialization_partition``) recomputes the post-attention norm's
output from the block input, o_proj's output and the rsqrt, and ``act(gate)·up`` from the gate and up, and re-casts them
to fp8 for the weight gradients (torchao/float8/float8_linear.py ``matmul_with_hp_or_float8_args.backward``). Each cast
(torchao/float8/float8_training_tensor.py ``hp_tensor_and_scale_to_float8``: ``tensor.to(float32) * scale``, then
float8_utils.py ``to_fp8_saturated``'s clamps) holds two fp32 copies of its operand at a time; a 16-bit operand is
freed by its fp32 copy. The weight of each input gradient is cast again from itself and the kept amax (out·in·4 twice).
Down the MLP's backward, beside the residual stream's gradient and the zero-filled KV-cache tangents
(``compiled_block_moment.cache_tangents``), five moments (:func:`float8_uncheckpointed_moments`):

* ``down_cast``: down_proj's weight cast for its input gradient, its fp8 grad_output (T·H, + its fp32 scale) held for
  the weight gradient;
* ``product``: the recomputed ``silu(gate)·up`` cast for down_proj's weight gradient: down_proj's input gradient
  (T·F·a), the gate's fp32 copy (``silu``'s decomposition upcasts it; the 16-bit gate freed), ``silu(gate)`` (T·F·a)
  held for the product's backward, the grad_output's fp8 and its scale;
* ``up_cast``: up_proj's weight cast for its input gradient, down_proj's weight gradient made, SiLU's gradient
  (``grad·up``, T·F·a) and up_proj's fp8 grad_output (T·F) held; up, ``silu(gate)`` and the product's input gradient
  freed;
* ``silu``: SiLU's backward (three fp32 T·F values: the upcast gradient, ``sigmoid(gate)``, their product), up_proj's
  weight gradient made, up_proj's input gradient (T·H·a); the recomputed post-attention norm's fp32 input (T·H·4: the
  residual sum, o_proj's output freed by it) and normalized product (T·H·a), which its backward reads, and its output's
  fp8 cast (T·H + scale), held for gate_proj's weight gradient;
* ``gate_cast``: gate_proj's weight cast for its input gradient, SiLU's temporaries and the gate freed, gate_proj's fp8
  grad_output (T·F + scale) held.

Each linear's kept amax is freed by its weight's cast, its inverse scale by its input gradient.
Read off the trace (``trace/compiled.py``: the partitioned graphs run op by op on fake tensors, no fusion) of the tiny
Llama (H 64, F 176, 2 blocks, B 2 S 64) under FSDP2, where ``silu`` is the step's peak, and checked in bf16, fp16, fp32,
amp-bf16 and fsdp-bf16 (tests/estimate/test_float8_compiled_recompute.py ``NONE_CASES``). Inductor fuses the casts'
pointwise chains (no fp32 copies on a GPU): this is the unfused graph's moment, as compiled_block_moment.py's is.

Under FSDP2's fp8 all-gather one more moment, the attention's input gradients summed beside every weight gradient of
the block (:func:`gathered_attention_parts`): the step's peak with few tokens beside fp32 weight gradients.

Under autocast (amp-bf16, :func:`_autocast_parts`) the residual gradient, up_proj's input gradient and the norm's
product are fp32 (the residual stream's dtype), a 4-byte kept amax is the weight's scale itself (no new scale in
the weight casts; fp32 too), and two more moments: each fp32 weight gradient beside the bf16 ``_scaled_mm`` output it
is cast from (traced: estimate == trace, SMALL_V 2,239,660 B, FSDP2 2,357,804 B).

Under FSDP2's fp8 all-gather (estimate/compiled_float8_gathered.py: no amax, some weights' column-major fp8 copies
saved, the forward scales held to the block's backward) the weights arrive cast: no weight-cast moment, each copy
freed by its input gradient (traced: GATHERED_CASES).

Known limitations: only the Llama set with every linear converted; ``rowwise``: bf16 only
(estimate/compiled_float8_rowwise.py); the attention's and the norms' backward moments are not modelled: with few
tokens beside large weights the attention's weight casts, all the MLP's gradients made, peak above these (H 128 F 256
B 1 S 32 fp32: 5,110,028 B vs 5,082,028 B in block 1, 5,523,412 B vs 5,499,508 B in block 0; the embedding's backward,
5,531,976 B, was the step's peak).
"""

from __future__ import annotations

from trainmem.estimate.compiled_float8_rowwise import is_rowwise_block, rowwise_uncheckpointed_moments
from trainmem.inventory import MemoryItem, dtype_bytes

__all__ = ["float8_uncheckpointed_moments", "gathered_attention_parts", "is_float8_block"]

_FP32 = dtype_bytes("float32")
_SCALE = _FP32  # tensorwise: one fp32 scale per cast (estimate/float8.py fp8_cast_bytes)
_LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
            "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
_KEPT = ("post_attention_layernorm.rsqrt", "self_attn.o_proj.out", "self_attn.k_rope", "mlp.gate_proj.out",
         "mlp.up_proj.out")


def is_float8_block(kept: dict[str, MemoryItem]) -> bool:
    """Whether ``kept`` (a block's compiled saved set by path inside the block) is the tensorwise Float8 Llama set
    (the norms' outputs and the product recomputed, an amax and an inverse scale per linear) or the bf16 rowwise one
    (estimate/compiled_float8_rowwise.py)."""
    recomputed = ("mlp.act_mul_up", "post_attention_layernorm.out")
    amaxes = sum(f"{n}.amax" in kept for n in _LINEARS)  # none: FSDP2's fp8 all-gather (compiled_float8_gathered.py)
    return is_rowwise_block(kept) or (all(n in kept for n in _KEPT) and not any(n in kept for n in recomputed)
                                      and all(f"{n}.scale_inv" in kept for n in _LINEARS)
                                      and amaxes in (0, len(_LINEARS)))


def float8_uncheckpointed_moments(kept: dict[str, MemoryItem], grads: dict[str, int], residual_bytes: int, *,
                                  tangents: int) -> list[dict[str, int]]:
    """The five moments (module docstring) as ``compiled_block_moment.uncheckpointed_moments`` returns them, for a block
    whose saved set is ``kept`` (:func:`is_float8_block`); ``grads``: down_proj's and up_proj's weight gradient bytes;
    ``tangents``: the zero-filled KV-cache tangents alive. ``rowwise``: a moment at every allocation of its replayed
    backward (estimate/compiled_float8_rowwise.py). Under autocast (a fp32 residual stream ``x`` beside bf16 linears,
    fp32 weights): see :func:`_autocast_parts`."""
    if is_rowwise_block(kept):
        return rowwise_uncheckpointed_moments(kept, residual_bytes, tangents=tangents)
    gate, up, o = kept["mlp.gate_proj.out"], kept["mlp.up_proj.out"], kept["self_attn.o_proj.out"]
    a = dtype_bytes(gate.dtype)
    tokens_h = o.bytes // a  # T·H
    x = residual_bytes // tokens_h  # the residual stream's dtype: up_proj's input gradient, the norm's product
    tokens_f = gate.bytes // a  # T·F
    weight_cast = 2 * gate.shape[-1] * o.shape[-1] * _FP32  # an F·H weight's fp32 copy and its scaled product

    def amax(linear: str) -> int:  # a weight's kept amax, freed by its cast (none under the fp8 all-gather)
        return getattr(kept.get(f"mlp.{linear}.amax"), "bytes", 0)

    def scalars(*linears: str) -> int:  # what a linear's input gradient frees of the block's saved set
        return sum(kept[f"mlp.{c}.{s}"].bytes for c in linears for s in ("amax", "scale_inv", "weight_t_fp8")
                   if f"mlp.{c}.{s}" in kept)

    gate32 = tokens_f * _FP32
    copy, copied = (gate32, gate.bytes) if a < _FP32 else (0, 0)  # the gate's fp32 copy (fp32: the gate itself)
    amp = _autocast_parts(kept, grads, a, x)
    # FSDP2's fp8 all-gather: the weights arrive cast, their column-major copies saved (compiled_float8_gathered.py):
    # no weight cast, only the product's cast and SiLU's backward
    gathered = "mlp.down_proj.amax" not in kept
    # a weight cast's fp32 scale, made from the kept amax; a 4-byte amax (fp32 weights) is the scale itself, kept
    w_scale = 0 if gathered or kept["mlp.down_proj.amax"].bytes == _FP32 else _SCALE
    base = residual_bytes + tangents + amp["k_tangent"]
    out = kept["residual_mlp"].bytes if "residual_mlp" in kept else 0  # the block output, freed by its reader
    # FSDP2's fp8 all-gather: the forward scales, replaced once the block's backward all-gather was waited on
    out += sum(i.bytes for n, i in kept.items() if n.endswith(".param_scale"))
    fp8_grad_h, fp8_grad_f = tokens_h + _SCALE, tokens_f + _SCALE  # a grad_output's fp8 cast and its scale
    norm = tokens_h * (_FP32 + x) + tokens_h + _SCALE  # the norm's fp32 input and product, its output's fp8 cast
    no_grads = {"block_gradients": 0, "new_gradients": 0, "after_attention": 0}
    two = {"block_gradients": grads["down_proj"] + grads["up_proj"],
           "new_gradients": grads["down_proj"] + grads["up_proj"], "after_attention": 0}
    moments = [  # down_cast, product, up_cast, silu, gate_cast (module docstring)
        {**no_grads, "freed_activations": out + amax("down_proj"),
         "work": base + fp8_grad_h + w_scale + weight_cast},
        {**no_grads, "freed_activations": out + copied + scalars("down_proj"),
         "work": base + fp8_grad_h + 2 * tokens_f * a + copy + _SCALE + 2 * gate32},
        {"block_gradients": grads["down_proj"], "new_gradients": grads["down_proj"], "after_attention": 0,
         "freed_activations": out + copied + up.bytes + scalars("down_proj") + amax("up_proj"),
         "work": base + copy + tokens_f * a + fp8_grad_f + w_scale + weight_cast},
        {**two, "freed_activations": out + copied + up.bytes + o.bytes + scalars("down_proj", "up_proj"),
         "work": base + tokens_h * x + copy + norm + 3 * gate32},
        {**two, "freed_activations": out + gate.bytes + up.bytes + o.bytes + scalars("down_proj", "up_proj")
         + amax("gate_proj"),
         "work": base + tokens_h * x + norm + fp8_grad_f + w_scale + weight_cast},
    ]
    if gathered:  # no weight cast moments (down_cast, up_cast, gate_cast); the attention's input gradients summed
        freed = sum(i.bytes for n, i in kept.items() if n != "input_layernorm.rsqrt")
        moments = moments[1::2] + gathered_attention_parts(kept, grads, residual_bytes, amp["mm_out"] > 0, freed=freed)
    if amp["mm_out"]:  # the fp32 weight gradients made from _scaled_mm's bf16 output, both alive for a moment
        moments += [
            {"block_gradients": grads["down_proj"], "new_gradients": grads["down_proj"], "after_attention": 0,
             "freed_activations": out + copied + scalars("down_proj"),
             "work": base + copy + 2 * tokens_f * a + amp["mm_out"]},
            {**two, "freed_activations": out + copied + up.bytes + o.bytes + scalars("down_proj", "up_proj"),
             "work": base + copy + tokens_f * a + tokens_h * a + norm + amp["mm_out"]},  # up's dX still bf16
        ]
    return moments


def gathered_attention_parts(kept: dict[str, MemoryItem], grads: dict[str, int], residual_bytes: int,
                             autocast: bool, *, freed: int, work: int = 0) -> list[dict[str, int]]:
    """Under the fp8 all-gather, the end of the attention's backward: q's input gradient summed onto k's and v's
    (T·H each in the residual stream's dtype ``x``), beside the residual gradient, the recomputed input norm's
    normalized product (T·H·x, for its weight gradient) and every weight gradient of the block but the input norm's
    (each the down_proj gradient's bytes per element: one dtype, one sharding); the rotary cos/sin freed too
    (``after_attention``). ``kept``: the block's compiled saved set without checkpointing (the linears' dtype ``a``
    read off it); ``freed``: what of the block's saved bytes is gone by then (all of ``kept`` but the input norm's
    rsqrt without checkpointing); ``work``: what else the caller's block holds there (a checkpointed block: its
    recomputed rsqrt, estimate/compiled_float8_recompute.py). Under autocast q's weight gradient is cast from
    ``_scaled_mm``'s bf16 output (width·H·a beside it) while q's input gradient is still bf16 (T·H·a): a moment of
    its own (see :func:`_autocast_parts`). Read off the trace of H 128 F 256 B 1 S 32 under FSDP2 (fsdp dp 2, fp32 and
    amp-bf16: the step's peak, in block 0, where the few tokens sit beside fp32 weight gradients), with and without
    checkpointing."""
    o, gate = kept["self_attn.o_proj.out"], kept["mlp.gate_proj.out"]
    a = dtype_bytes(gate.dtype)
    hidden, width, kv = o.shape[-1], kept["self_attn.q_rope"].shape[-1], kept["self_attn.k_rope"].shape[-1]
    tokens_h = o.bytes // a
    x = residual_bytes // tokens_h  # the residual stream's dtype
    elements = 3 * gate.shape[-1] * hidden + 2 * width * hidden + 2 * kv * hidden + hidden  # MLP, o and q, k and v, norm
    made = grads["down_proj"] * elements // (gate.shape[-1] * hidden)
    at = {"block_gradients": made, "new_gradients": made, "after_attention": 1, "freed_activations": freed}
    held = residual_bytes + 2 * tokens_h * x + work  # the residual gradient, the normalized product, k's and v's sum
    moments = [{**at, "work": held + 2 * tokens_h * x}]  # q's input gradient and the sum
    if autocast:
        moments.append({**at, "work": held + tokens_h * a + width * hidden * a})
    return moments


def _autocast_parts(kept: dict[str, MemoryItem], grads: dict[str, int], a: int, x: int) -> dict[str, int]:
    """What autocast adds to the moments (traced: tiny Llama amp-bf16; none in a pure precision): the cache's roped k
    in the residual stream's dtype (LlamaRotaryEmbedding casts cos/sin to the fp32 hidden states' dtype; the saved
    ``k_rope`` is SDPA's bf16 copy), so its tangent is ``x`` wide (``k_tangent``, beyond the bf16 one counted); and a
    weight gradient's ``_scaled_mm`` output in bf16 (``mm_out``, F·H·a) beside its fp32 cast, the ``.grad``
    (float8_linear.py ``matmul_with_hp_or_float8_args.backward`` returns the mm's dtype; autograd casts it to the
    fp32 weight's). Two more moments: down_proj's weight gradient (beside the product's input gradient and
    ``silu(gate)``) and up_proj's (beside its still-bf16 input gradient and the recomputed norm)."""
    fh = kept["mlp.gate_proj.out"].shape[-1] * kept["self_attn.o_proj.out"].shape[-1]
    return {"k_tangent": kept["self_attn.k_rope"].bytes // a * (x - a),
            "mm_out": fh * a if grads["down_proj"] != fh * a else 0}
