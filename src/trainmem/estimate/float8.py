"""Float8 training as torchao does it (``torchao.float8.convert_to_float8_training``, torchao 0.18).

Which linears are converted
  torchao swaps every ``nn.Linear`` its ``module_filter_fn`` accepts for a ``Float8Linear``
  (torchao/float8/float8_linear_utils.py, ``swap_linear_layers``). The filter modelled is
  torchtitan's (torchtitan/components/quantization/utils.py, ``module_filter_fn``): both weight
  dims multiples of 16, and no filtered name; torchtitan's shipped configs filter the output head
  (``filter_fqns = ["output"]``), here every family's output layer (``trainmem.names.is_head``)
  and the task heads :data:`TASK_HEADS`.
  Hugging Face modules that are not ``nn.Linear`` are never converted: GPT-2's ``Conv1D``
  blocks and the MoE routers (``MixtralTopKRouter`` holds a bare weight).

What a Float8Linear keeps for backward (eager)
  ``matmul_with_hp_or_float8_args.forward`` (torchao/float8/float8_linear.py) saves its
  high-precision ``input_hp`` and ``weight_hp_t`` -- a view of the parameter, no new storage --
  whenever autograd records the Function, and re-casts both to fp8 in backward. So without
  autocast a Float8Linear keeps exactly what ``nn.Linear`` keeps. Under autocast,
  ``Float8Linear.forward`` casts only the input (to CUDA's autocast dtype, read with
  ``torch.is_autocast_enabled()``); the weight reaches the fp8 cast as stored, so the per-linear
  weight copy autocast's ``F.linear`` keeps (:meth:`Ctx.plain_linear`) is not kept. A bias is added
  after the fp8 matmul (``output + bias.to(output.dtype)``), which keeps nothing.
  Under op-level checkpointing the policy's dispatch mode sees the ``aten.mm`` on torchao's fp8
  subclass tensors (counted like any mm) and, with ``tensorwise``, the ``aten.max`` of each amax
  (a scalar of the input's and of the weight's dtype), which torchtitan's policy keeps.

The fp8 copies themselves (input and weight in forward; grad_output, weight and input again in
backward, each 1 byte per element plus an fp32 scale: one per tensor for ``tensorwise``, one per
row for ``rowwise``) are transients of the matmul: :func:`fp8_cast_bytes` sizes them. Under
FSDP2 with ``enable_fsdp_float8_all_gather`` the converted weights are all-gathered in fp8
(torchao/float8/fsdp_utils.py, ``WeightWithDynamicFloat8CastTensor.fsdp_pre_all_gather``: the
local shard is cast, the fp8 bytes travel and are kept unsharded): :func:`gathered_bytes_per_element`.

Known limitations:
  - torch.compile: modelled per block (:func:`compiled_input_recomputed`, :func:`compiled_scales`,
    below), for dense Llama-family blocks without q/k/v biases or q/k norms at ``--recompute none`` (the backward's
    moments, tensorwise: estimate/compiled_float8_moment.py), and
    tensorwise at ``--recompute full`` (the checkpointed block's backward moments:
    estimate/compiled_float8_recompute.py); the whole model compiled as one region is traced
    (``trace --compile``), not estimated (``rules_compiled.check_compiled`` refuses it).
  - a real CPU run without CUDA's autocast state does not cast the input; the tracer sets CUDA's
    autocast state beside CPU's so that the CPU run takes the CUDA path.
"""

from __future__ import annotations

import math
from functools import lru_cache

from trainmem.errors import UnsupportedError
from trainmem.families import get_family
from trainmem.specs.float8_filter import TASK_HEADS, converted, is_linear_module

__all__ = ["TASK_HEADS", "compiled_input_recomputed", "compiled_scales", "converted", "converted_parameters",
           "float8_linear", "fp8_cast_bytes", "gathered_bytes_per_element", "is_linear_module"]

def float8_linear(ctx, x, out_features: int, out_sym: str, *, weight: tuple[int, int], label: str, bias: bool):
    """A ``Float8Linear`` call (see the module docstring): keeps its (autocast-cast) input whenever
    the input or the weight needs a gradient; the output is the input's dtype."""
    g = ctx.graph
    wt = ctx.weight_trainable()
    rg = x.requires_grad or wt
    xin = ctx.cast(x, ctx.low, "input_cast") if ctx.low else x
    tp_fp8 = ctx.impl.float8 == "tensorwise" and ctx.shard.tp > 1
    g.save(_tp_fp8_input(ctx, xin) if tp_fp8 else xin, when=rg)  # save_for_backward: no per-operand condition
    if ctx.impl.float8 == "tensorwise":
        # float8_utils.py tensor_to_amax: torch.max(torch.abs(x)), an aten.max an op-level policy
        # keeps (a scalar); an fp8 all-gathered weight arrives cast, its amax taken before the gather
        g.new("input_amax", (), (), xin.dtype, False, op="max")
        if not ctx.impl.float8_all_gather:
            g.new("weight_amax", (), (), ctx.param, False, op="max")
    shape, dims = x.shape[:-1] + (out_features,), x.dims[:-1] + (out_sym,)
    # torch.mm on the fp8 subclass tensors: a dispatch mode (the op-level policy) sees aten.mm
    if not bias:
        return g.new(label, shape, dims, xin.dtype, rg, op="mm")
    g.new("fp8_mm", shape, dims, xin.dtype, rg, op="mm")
    return g.new(label, shape, dims, xin.dtype, rg)


def _tp_fp8_input(ctx, x):
    """Float8 tensor parallelism, tensorwise (torchtitan's ``apply_tp`` with
    ``enable_float8_tensorwise_tp``: torchao/float8/float8_tensor_parallel.py ``Float8ColwiseParallel``,
    ``Float8RowwiseParallel``, ``PrepareFloat8ModuleInput``): each style's input hook casts the
    input to fp8 (an all-reduced amax, one fp32 scale) before any redistribution, so the
    sequence-parallel all-gather moves fp8 and the ``Float8Linear`` receives, and keeps for backward,
    the fp8 tensor (1 byte per element plus its scale) instead of the high-precision input. With
    sequence parallelism ``PrepareFloat8ModuleInput`` casts the attention's and the MLP's input once
    for q/k/v and for gate/up (one kept tensor each; tensorwise TP without SP is refused, parallel.py).
    ``rowwise`` takes the plain styles (torchtitan): the eager rule at TP shapes."""
    g = ctx.graph
    shared = ctx.__dict__.setdefault("_float8_tp_inputs", {})
    key = (x.name, x.seq)
    if key not in shared:
        shared[key] = g.new("fp8_input", x.shape, x.dims, "float8", False)
        g.save(g.new("fp8_scale", (), (), "float32", False))
    return shared[key]


def fp8_cast_bytes(recipe: str, rows: int, cols: int) -> int:
    """Bytes of one fp8 cast of a (rows, cols) tensor: 1 byte per element plus fp32 scales --
    one for ``tensorwise``, one per row for ``rowwise`` (torchao/float8/float8_utils.py
    ``tensor_to_scale``: ``amax`` over the last dim with ``keepdim``)."""
    if recipe == "tensorwise":
        return rows * cols + 4
    if recipe == "rowwise":
        return rows * cols + 4 * rows
    raise UnsupportedError(f"float8 recipe {recipe!r} has no fp8 cast (tensorwise or rowwise)")


def gathered_bytes_per_element(impl, model, weight_path: str, weight: tuple[int, ...], compute_bytes: int) -> int:
    """Bytes per element FSDP2 all-gathers for one parameter: 1 for a converted linear weight
    under ``float8_all_gather`` (the fp8 payload; its scale is one fp32 per tensor), else
    ``compute_bytes`` (``MixedPrecisionPolicy.param_dtype``)."""
    if impl.float8_all_gather and converted(model, weight_path, weight):
        return 1
    return compute_bytes


@lru_cache(maxsize=64)
def converted_parameters(model) -> int:
    """Weights in the linears torchao converts (:func:`converted` over the model's parameters):
    their matmuls are the FLOPs that run at the FP8 rate (``plan/cost.py``)."""
    from trainmem.estimate.params import parameter_shapes
    return sum(math.prod(shape) for name, shape in parameter_shapes(model) if converted(model, name, shape))


# torch.compile (per-block scope) -----------------------------------------------------------------
# Read from the partitioned graphs of a tiny Llama's blocks compiled alone with torchao's Float8Linear
# (trace/compiled.py, inductor's min-cut partition; tests/estimate/test_float8_compiled.py). The
# partitioner recomputes a converted linear's high-precision input (matmul_with_hp_or_float8_args
# saves it, and backward re-casts it to fp8) when that input is pointwise in what the block keeps
# anyway: the two RMSNorm outputs (from the block input, o_proj's output and the rsqrt) and
# down_proj's act(gate)*up (from gate and up). No fp8 cast is kept: backward casts again from the
# recomputed input. With ``tensorwise`` each converted linear keeps two scalars, a ``max`` in the
# activation dtype and an fp32 ``reciprocal`` (the amax and the inverse scale _scaled_mm reads),
# rather than reducing again in backward; ``rowwise`` keeps no scale (its scales are per row of
# tensors recomputed in backward).

def compiled_input_recomputed(ctx, *linears: tuple[str, tuple[int, int]]) -> bool:
    """Whether a compiled block recomputes the input these linears (``(path under the current
    scope, (out, in))``) share: only if torchao converts every one of them (an ``nn.Linear``'s mm
    reads its input in backward as saved)."""
    g = ctx.graph
    return ctx.impl.float8 != "none" and all(converted(ctx.model, g.path(f"{name}.weight"), weight)
                                             for name, weight in linears)


def compiled_scales(ctx, *linears: tuple[str, tuple[int, int]]) -> None:
    """The scalars a compiled block keeps per converted linear under ``tensorwise`` (see above). With FSDP2's fp8
    all-gather (the Llama block's seven linears in forward order) no amax, and the column-major fp8 copies of the
    weights estimate/compiled_float8_gathered.py names."""
    if ctx.impl.float8 != "tensorwise":
        return
    from trainmem.estimate.compiled_float8_gathered import saved_weight_copies
    g, a, gathered = ctx.graph, ctx.param, ctx.impl.float8_all_gather  # the weight's dtype (amp-bf16: fp32, traced)
    fp8 = {name: converted(ctx.model, g.path(f"{name}.weight"), weight) for name, weight in linears}
    # the block's graph inputs in first-use order: the hidden states, the input norm's weight, q/k/v, the rotary cos
    # and sin, o, the post-attention norm's weight, the MLP's (estimate/compiled_float8_gathered.py)
    names = [n for n, _ in linears]
    inputs = (("x", False, False), ("input_layernorm", True, False), *((n, True, fp8[n]) for n in names[:3]),
              ("cos", False, False), ("sin", False, False), (names[3], True, fp8[names[3]]),
              ("post_attention_layernorm", True, False), *((n, True, fp8[n]) for n in names[4:]))
    copies = saved_weight_copies(inputs) if gathered else set()
    for name, (out, inp) in linears:
        if fp8[name]:
            with g.module(name):
                g.save(g.new("amax", (), (), a, False), when=not gathered)
                g.save(g.new("scale_inv", (), (), "float32", False))
                g.save(g.new("weight_t_fp8", (inp, out), ("in", "out"), "float8", False), when=name in copies)
                # the forward all-gather's fp32 scale: the parameter's ``_scale`` until the block's backward all-gather
                # is waited on (compiled_float8_op.gathered_scales), not held by autograd
                g.save(g.new("param_scale", (), (), "float32", False), when=gathered)
