"""The moment inside a checkpointed compiled block's backward with torchao's Float8 (``--float8 tensorwise``,
``--compile`` per block, ``--recompute full``): torchtitan's Float8 + ``apply_compile`` + full activation checkpointing.

The block keeps its input alone (``rules_compiled.py`` ``_checkpointed_block``), as without Float8. Its backward graph
(``torch/_functorch/partitioners.py`` ``min_cut_rematerialization_partition``: the ``tag_activation_checkpoint``
region is recomputed, ``must_recompute``) runs down_proj's input gradient first (it reads the fp8 grad_output and
down_proj's weight, no recomputed value), then the block's forward again up to ``act(gate)·up`` (down_proj's forward is
not recomputed: its output is read by no backward node), then the weight gradients. The step peaks at one of three
moments (:func:`float8_checkpoint_moments`; which one depends on the shapes): down_proj's weight-gradient fp8 cast
of ``act(gate)·up``, SiLU's fp32 backward, or, with few tokens beside large weights, up_proj's weight cast in the
recomputed forward.

What the recomputed forward holds there, beyond what the bf16 block's recompute holds (estimate/compiled_recompute.py):

* each converted linear's fp8 weight and its fp32 inverse scale (``_scaled_mm``'s ``scale_b``), out·in + 4 B: the
  forward's cast (torchao/float8/float8_linear.py ``matmul_with_hp_or_float8_args.forward``: float8_scaling_utils.py
  ``hp_tensor_to_float8_dynamic`` on ``weight_hp_t``) is the same node as the backward's re-cast of ``weight_hp_t`` for the input gradient
  (``matmul_with_hp_or_float8_args.backward``: tensorwise, one scale per tensor, no dim-dependent layout), so the joint
  graph computes it once and holds it until the input-gradient mm; the input's forward cast is freed after its mm;
* the fp8 grad_output of down_proj (1 B per element, + its fp32 scale), kept from the input-gradient mm for the
  weight gradient, and that input gradient (the product's, a·B·S·F);
* the cast of ``act(gate)·up`` itself (torchao/float8/float8_training_tensor.py ``hp_tensor_and_scale_to_float8``:
  ``tensor.to(torch.float32) * scale``, then float8_utils.py ``to_fp8_saturated``'s clamps): its fp32 copy and the scaled product
  (2·B·S·F·4), the 16-bit product freed by its copy, and the fp32 scale (4 B);
* the recomputed forward's values a backward node reads: per RMSNorm the fp32 input, ``rsqrt``, the normalized
  product in the input's dtype and the output (the q/k/v and gate/up inputs, re-cast for the weight gradients);
  the attention's v, roped q and k, the SDPA output and log-sum-exp; SiLU's fp32 gate (``pw_cast_for_opmath``) and
  its 16-bit output; up. o_proj's output and the block's input are freed once the residual sum is made (a fp32
  block input, under autocast, is the input norm's fp32 input itself: held, and counted once).

Under autocast (amp-bf16: a fp32 residual stream, what the linears make bf16) the normalized products, the residual
gradient and up_proj's input gradient (autocast's cast backward) are in the residual stream's dtype; the norm outputs
are Float8Linear's bf16 input casts. Checked against the trace (``trace/compiled.py``: the partitioned graphs run op by
op on fake tensors, no fusion) in fp32, bf16, fp16 and amp-bf16 on one device and fsdp-bf16 under FSDP2
(``tests/estimate/test_float8_compiled_recompute.py``). Inductor fuses the casts'
pointwise chains (no fp32 copy of the product on a GPU: the fused cast kernel reads bf16 and writes fp8), so this is
the unfused graph's moment, as compiled_recompute.py's are.

Known limitations: ``rowwise`` has other moments: its weights are re-cast per column for the input gradient, so the
recomputed forward holds each weight's ``abs`` and fp32 copy instead, and its backward mms scale their output after
``_scaled_mm`` in fp32 (torchao's graph on every device, not a CPU artefact: float8_ops.py ``addmm_float8_unwrapped``,
the backward mms' ``Float8GemmConfig`` default has no fast accumulation; inductor may fuse it, as it fuses the casts).
Its block is replayed allocation by allocation instead (bf16 only): estimate/compiled_float8_rowwise_recompute.py, and
without checkpointing estimate/compiled_float8_rowwise.py, under ``--recompute op`` compiled_float8_rowwise_op.py. Only
the Llama block with every linear converted (SiLU, two RMSNorms, no fused projections) is read. Under FSDP2's fp8 all-gather the block receives its
weights cast (``compiled_float8_op.gathered_scales``): no weight cast, no ``up_cast`` or ``gate_cast`` moment, and
one more, as without checkpointing: the attention's input gradients summed beside every weight gradient of the block
(compiled_float8_moment.py ``gathered_attention_parts``), the recomputed input norm's rsqrt beside its normalized
product, the block input held for the norm's backward; the step's peak with few tokens beside fp32 weight gradients
(H 128 F 256 B 1 S 32 fp32 and amp-bf16, full and op: tests/estimate/test_float8_compiled_gathered_precisions.py).

Under ``--recompute op`` (torchtitan's policy inside the compiled block: estimate/compiled_float8_op.py) the same
moments run on what the policy left to recompute (``op_block``): the kept mms' weights (q, v, gate) are not cast
before their input gradients, their amaxes and inverse scales are held; with the SDPA output kept (CUDA) the
attention's recompute waits, as without Float8 (compiled_op_moment.py). One more moment: gate_proj's weight cast
for its input gradient, after SiLU's backward. Checked against the trace (one device, FSDP2, the CPU SDPA kernel
standing in for CUDA's: tests/estimate/test_float8_compiled_op.py); ``up_cast`` under op is not seen to peak there.
"""

from __future__ import annotations

from trainmem.estimate.block_backward import block_items
from trainmem.estimate.compiled_block_moment import block_grads
from trainmem.estimate.compiled_float8_moment import gathered_attention_parts
from trainmem.estimate.compiled_float8_op import op_block
from trainmem.estimate.compiled_float8_rowwise import is_rowwise_block
from trainmem.estimate.compiled_float8_rowwise_op import rowwise_op_moments
from trainmem.estimate.compiled_float8_rowwise_recompute import rowwise_checkpoint_moments
from trainmem.inventory import Category, Inventory, MemoryItem, dtype_bytes
from trainmem.names import split_block

__all__ = ["float8_checkpoint_moments"]

_FP32 = dtype_bytes("float32")
_SCALE = _FP32  # tensorwise: one fp32 scale per cast (estimate/float8.py fp8_cast_bytes)
_NORMS = ("input_layernorm", "post_attention_layernorm")
# the block's linears, each converted (its tensorwise amax and inverse scale in the compiled set: float8.compiled_scales)
_LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
            "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
_KEPT = ("self_attn.q_rope", "self_attn.k_rope", "self_attn.v_proj.out", "self_attn.sdpa_out", "self_attn.lse",
         "self_attn.o_proj.out", "mlp.gate_proj.out", "mlp.up_proj.out", *(f"{n}.rsqrt" for n in _NORMS))


def float8_checkpoint_moments(items: "Inventory | list[MemoryItem]", last: int, residual_bytes: int,
                              recomputed: "Inventory | list[MemoryItem]") -> list[dict[str, int]]:
    """Block ``last``'s Float8 moment (see the module docstring) as ``compiled_recompute.compiled_checkpoint_moments``
    returns its moments, or nothing unless ``recomputed`` (the block's compiled saved set without checkpointing) is the
    tensorwise Float8 set of a Llama block with every linear converted (``estimate/float8.py`` ``compiled_scales``:
    an amax and an inverse scale per converted linear; ``compiled_input_recomputed``: no norm output or product)."""
    kept = {_inner(i.name): i for i in block_items(recomputed, last) if i.category is Category.ACTIVATION}
    if is_rowwise_block(kept):  # rowwise (bf16): replayed, compiled_float8_rowwise_recompute.py (full), _op.py (op)
        own = {_inner(i.name): i for i in block_items(items, last) if i.category is Category.ACTIVATION}
        if any(n.endswith(".out") for n in own):  # the op policy's kept outputs
            return rowwise_op_moments(own, kept, residual_bytes)
        return rowwise_checkpoint_moments(kept, residual_bytes)
    if any(n not in kept for n in _KEPT) or any(f"{n}.scale_inv" not in kept for n in _LINEARS) or any(
            f"{n}.out" in kept for n in _NORMS) or "mlp.act_mul_up" in kept:
        return []
    q, k, v = (kept[n] for n in _KEPT[:3])
    gate, up, o = kept["mlp.gate_proj.out"], kept["mlp.up_proj.out"], kept["self_attn.o_proj.out"]
    a = dtype_bytes(gate.dtype)  # what the linears make
    tokens_h = o.bytes // a  # B·S·H
    x = residual_bytes // tokens_h  # the residual stream's dtype: the block input, the norms' inputs
    tokens = tokens_h // o.shape[-1]
    hidden, width, kv_width, ffn = o.shape[-1], q.shape[-1], k.shape[-1], gate.shape[-1]
    weights = {"q_proj": width * hidden, "k_proj": kv_width * hidden, "v_proj": kv_width * hidden,
               "o_proj": hidden * width, "gate_proj": ffn * hidden, "up_proj": ffn * hidden}
    # --recompute op: what the policy kept changes what is re-run and held (estimate/compiled_float8_op.py)
    op = op_block(block_items(items, last), kept)
    # each recast weight: 1 B per element and its inverse scale; FSDP2's fp8 all-gather hands the block its weights
    # cast (FSDP2's buffers, estimate/fsdp_timeline.py): the inverse scale alone
    fp8 = {c: (0 if op.gathered else n) + _SCALE for c, n in weights.items()}
    fp8_weights = sum(fp8[c] for c in op.recast)
    # per RMSNorm: the fp32 input, rsqrt (kept[...].bytes), the normalized product (x) and the output (a)
    norms = sum(tokens_h * (_FP32 + x + a) + kept[f"{n}.rsqrt"].bytes for n in _NORMS[op.deferred:])
    attention = 0 if op.deferred else (q.bytes + k.bytes + v.bytes + kept["self_attn.sdpa_out"].bytes
                                       + kept["self_attn.lse"].bytes)
    mlp = gate.bytes // a * _FP32 + gate.bytes + up.bytes  # SiLU's fp32 gate, its 16-bit output, up
    backward = residual_bytes + tokens_h + _SCALE + gate.bytes  # the residual gradient, down's fp8 grad_output, dX
    cast = 2 * tokens * ffn * _FP32 + _SCALE  # act(gate)·up in fp32 and scaled, its scale
    # the compiled set (recomputed), the block's own saved values it lacks, the block input, less what is held
    freed = sum(i.bytes for i in kept.values()) + op.extra + (0 if op.deferred else tokens_h * x) - op.held
    weight_cast = {"block_gradients": 0, "new_gradients": 0, "freed_activations": freed, "after_attention": 0,
                   "work": backward + fp8_weights + norms + attention + mlp + cast}
    # SiLU's backward, after up_proj's weight and input gradients: up's fp8 weight, up, SiLU's output and the gate/up
    # input were freed (the input's fp8 cast, one node for both weight gradients, is held for gate_proj's), up's input
    # gradient waits for gate's; silu_backward decomposed in fp32 (the upcast gradient, sigmoid(gate), their product)
    grads = block_grads(block_items(items, last))
    silu = {"block_gradients": grads["down_proj"] + grads["up_proj"],
            "new_gradients": grads["down_proj"] + grads["up_proj"], "freed_activations": freed, "after_attention": 0,
            "work": residual_bytes + fp8_weights - fp8["up_proj"] + norms - tokens_h * a + attention
            + tokens_h + _SCALE + tokens_h * x + 4 * tokens * ffn * _FP32}
    # in the recomputed forward, up_proj's weight cast (x.to(float32) * scale, then the clamps: 2·F·H·4), gate_proj
    # and SiLU done: the gate/up input's fp8 cast (the same node gate's mm read) and its scale, the weight's scale
    up_cast = {"block_gradients": 0, "new_gradients": 0, "freed_activations": freed, "after_attention": 0,
               "work": backward + fp8_weights - weights["up_proj"] - _SCALE + norms + attention + tokens_h + _SCALE
               + gate.bytes // a * _FP32 + gate.bytes + _SCALE + 2 * weights["up_proj"] * _FP32}
    if op.gathered:  # no weight is cast in the block; the attention's input gradients summed (module docstring)
        # everything the block saved is read by then; the block input stays, the input norm's backward reads it
        return [weight_cast, silu, *gathered_attention_parts(
            kept, grads, residual_bytes, x != a, freed=sum(i.bytes for i in kept.values()) + op.extra,
            work=kept["input_layernorm.rsqrt"].bytes)]
    if "gate_proj" in op.recast:
        return [weight_cast, silu, up_cast]
    # --recompute op, gate_proj's mm kept: its weight is cast for its input gradient after SiLU's backward (2·F·H·4,
    # its amax read and freed), beside its fp8 grad_output and scale and the scale of the weight cast; SiLU's
    # temporaries freed, up's input gradient waiting (traced: H 128 F 256 B 1 S 32)
    gate_cast = {**silu, "freed_activations": freed + op.gate_amax,
                 "work": silu["work"] - 4 * tokens * ffn * _FP32 + tokens * ffn + 2 * _SCALE
                 + 2 * weights["gate_proj"] * _FP32}
    return [weight_cast, silu, up_cast, gate_cast]


def _inner(name: str) -> str:
    parts = split_block(name)
    return parts[2] if parts else name
