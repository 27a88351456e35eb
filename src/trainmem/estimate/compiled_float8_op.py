"""What a block compiled around torchtitan's op-level checkpoint keeps with torchao's Float8 tensorwise
(``--float8 tensorwise --compile --compile-scope block --recompute op``: torchtitan's FSDP + compile + Float8 rows
with ``selective_ac_option = "op"``).

What the policy sees. Under compile the selective-checkpoint dispatch mode runs while AOTAutograd traces the
``tag_activation_checkpoint`` region, above torchao's ``Float8TrainingTensor`` (a mode dispatches before a
subclass): it sees ``aten.mm`` on the fp8 subclass tensors (``float8_linear.py``
``matmul_with_hp_or_float8_args.forward``: ``torch.mm(input_fp8, weight_fp8_t)``), counts it as any mm, and its
decision tags the ops the subclass desugars it into (``float8_ops.py`` ``float8_mm`` -> ``addmm_float8_unwrapped``:
``a_scale.reciprocal()``, ``b_scale.reciprocal()``, ``_scaled_mm``). Every ``aten.max`` (``float8_utils.py``
``tensor_to_amax``: ``torch.max(torch.abs(x))``) is MUST_SAVE. torchtitan 9dec370's ``_save_list``
(``parallelisms/parallelize_llama.py``) also lists ``aten.abs``: no backward node reads an ``abs`` (its ``max`` is
kept), so the partition is the same (traced with that list: the same saved set and step peak). So the Llama block
keeps q, v and the gate (the 1st, 3rd, 5th mm, as without Float8: ``rules_compiled._op_block``) and, of the
scalars, those a backward node or a recomputed one reads that the partitioner may not recompute
(``torch/_functorch/partitioners.py`` ``must_recompute`` / ``should_ban_recomputation``):

* every converted weight's amax (its dtype): the backward's re-cast of ``weight_hp_t`` for the input gradient is
  the forward's cast (tensorwise: one scale per tensor; the joint graph's CSE merges them), recomputed from the
  weight and this amax;
* a weight's fp32 inverse scale (``b_scale.reciprocal()``) where its mm was kept: tagged MUST_SAVE with it, and
  read by that input-gradient mm;
* an input's amax where a linear that reads the input is recomputed and its output is read in backward (the
  recomputed cast needs it; q/k/v share one cast, gate/up one, once the graph's CSE merged them): k's, o's and
  up's inputs in the Llama block, not down_proj's (its output is read by no backward node);
* that input's fp32 inverse scale (``a_scale.reciprocal()``) where its first reader's mm was kept (the merged
  node carries the first reader's tag) and a later reader is recomputed: q/k/v's and gate/up's.

Tiny Llama bf16: 10 amaxes (2 B) and 6 inverse scales (4 B) per block, 44 B beside the policy's outputs
(tests/estimate/test_float8_compiled_op.py). The backward's moment: compiled_float8_recompute.py
(``float8_checkpoint_moments``, the kept linears' weights not recomputed).

Rowwise (``--float8 rowwise``: torchao/float8/config.py ``Float8LinearConfig.from_recipe_name``, axiswise scales).
Each amax is ``torch.amax(torch.abs(x), dim, keepdim=True)`` (float8_utils.py ``tensor_to_amax``), an ``aten.amax``
the policy does not list: recomputed. A weight is cast per output for its forward mm and per input column for its
input gradient, so no forward scale of a weight is read in backward. What is kept beside the policy's outputs is an
input cast's fp32 inverse scale per row, (B·S, 1), made by ``addmm_float8_unwrapped``'s ``a_scale.reciprocal()`` and
tagged with the first reader's mm, where that mm was kept and a later reader is recomputed (it reads the same
CSE-merged cast): q/k/v's and gate/up's in the Llama block (tiny Llama bf16 B 2 S 64: 2 x 512 B per block, traced).
The backward's moments: compiled_float8_rowwise_op.py.
"""

from __future__ import annotations

from dataclasses import dataclass

from trainmem.estimate.float8 import converted
from trainmem.inventory import Category, MemoryItem
from trainmem.names import split_block

__all__ = ["CASTS", "OpBlock", "fp8_gathered", "gathered_scales", "op_block", "op_float8_scalars"]

# the block's fp8 input casts, each with the linears that read it in forward order (one node once CSE merged them)
CASTS = ((("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), "self_attn.q_proj"),
         (("self_attn.o_proj",), "self_attn.o_proj"), (("mlp.gate_proj", "mlp.up_proj"), "mlp.gate_proj"),
         (("mlp.down_proj",), "mlp.down_proj"))
_UNREAD = "mlp.down_proj"  # its output is read by no backward node: never recomputed


def op_float8_scalars(ctx, kept_mm: dict[str, bool], weights: dict[str, tuple[int, int]]) -> None:
    """Save the tensorwise scalars (module docstring) of an op-checkpointed compiled block whose linears' mms the
    policy kept or not (``kept_mm``, by path inside the block; ``weights``: their (out, in)). Nothing unless every
    linear is converted with ``tensorwise`` (``check_compiled`` refuses the rest)."""
    g = ctx.graph
    if ctx.impl.float8 not in ("tensorwise", "rowwise") or not all(
            converted(ctx.model, g.path(f"{n}.weight"), w) for n, w in weights.items()):
        return
    if ctx.impl.float8 == "rowwise":
        _rowwise_scales(ctx, kept_mm)
        return
    a = ctx.param  # the weight's dtype
    x = ctx.low or a  # the input's: autocast's compute dtype (its bf16 copy is what Float8Linear casts)
    if ctx.impl.float8_all_gather:  # the weights arrive cast: no amax, the gathered scale kept (gathered_scales)
        gathered_scales(ctx, weights, kept_mm)
    for name in kept_mm:
        with g.module(name):
            g.save(g.new("weight_amax", (), (), a, False), when=not ctx.impl.float8_all_gather)
            g.save(g.new("weight_scale_inv", (), (), "float32", False),
                   when=kept_mm[name] and not ctx.impl.float8_all_gather)
    for readers, first in CASTS:
        recomputed = any(not kept_mm[r] and r != _UNREAD for r in readers)
        with g.module(first):
            g.save(g.new("input_amax", (), (), x, False), when=recomputed)
            g.save(g.new("input_scale_inv", (), (), "float32", False), when=recomputed and kept_mm[first])


def _rowwise_scales(ctx, kept_mm: dict[str, bool]) -> None:
    """``rowwise`` (module docstring, "Rowwise"): each input cast's fp32 inverse scale per row, (B·S, 1), where its first
    reader's mm was kept and a later reader is recomputed; no amax (``aten.amax``, not on the policy's list)."""
    g = ctx.graph
    for readers, first in CASTS:
        if kept_mm[first] and any(not kept_mm[r] and r != _UNREAD for r in readers):
            with g.module(first):
                g.save(g.new("input_scale_inv", (ctx.B * ctx.S, 1), ("B·S", "1"), "float32", False))


def gathered_scales(ctx, weights: dict[str, tuple[int, int]], kept_mm: "dict[str, bool] | None" = None) -> None:
    """FSDP2's fp8 all-gather (``--float8-all-gather``: torchao/float8/fsdp_utils.py
    ``WeightWithDynamicFloat8CastTensor.fsdp_pre_all_gather`` casts the shard, ``fsdp_post_all_gather`` wraps the
    gathered bytes and the fp32 scale in a ``Float8TrainingTensor``): the compiled block's graph inputs are each
    converted weight's fp8 data (the unsharded parameter's storage) and its scale, a tensor of its own. The region
    keeps the scale (4 B per weight) for the backward's recompute and input gradients; under ``--recompute op``
    (``kept_mm``) a kept mm's weight keeps the scale's reciprocal instead (``b_scale.reciprocal()``, tagged with
    the mm), and its scale stays alive all the same: it is the unsharded parameter's ``_scale`` until the block's
    backward all-gather is waited on (``fsdp_post_all_gather``: ``out._scale = scale``), so it is counted here too
    (``param_scale``; autograd does not hold it: the trace's saved set is 4 B less per kept mm). Traced: tiny
    Llama, FSDP2 over the fake process group, --recompute full and op (tests/estimate/test_float8_compiled_op.py)."""
    g = ctx.graph
    if not (ctx.impl.float8_all_gather and ctx.impl.float8 == "tensorwise"):
        return
    for name, weight in weights.items():
        if converted(ctx.model, g.path(f"{name}.weight"), weight):
            with g.module(name):
                g.save(g.new("weight_scale", (), (), "float32", False), when=not (kept_mm or {}).get(name))
                if (kept_mm or {}).get(name):
                    g.save(g.new("weight_scale_inv", (), (), "float32", False),
                           g.new("param_scale", (), (), "float32", False))


def fp8_gathered(model, impl):
    """``(parameter item) -> bool``: whether FSDP2 gathers it in fp8 (``gathered_scales``; 1 B per element and its
    fp32 scale, estimate/float8.py ``gathered_bytes_per_element``), for estimate/fsdp_timeline.py ``units``; None
    without ``--float8-all-gather``."""
    if not impl.float8_all_gather:
        return None
    return lambda p: converted(model, p.name, tuple(p.shape))


@dataclass(frozen=True)
class OpBlock:
    """What an op-checkpointed Float8 block's MLP moments (compiled_float8_recompute.py) read of its own saved set:
    ``recast`` the linears (``q_proj``...) whose weights the recomputed forward casts to fp8 and holds until their
    input gradient; ``deferred`` whether the attention's recompute waits for its backward; ``held`` the block's own
    saved bytes held at the moments; ``extra`` its own saved bytes the recomputed set lacks; ``gate_amax`` the gate
    weight's amax, read by gate_proj's backward weight cast."""

    recast: frozenset[str]
    deferred: bool
    held: int
    extra: int
    gate_amax: int
    gathered: bool = False  # FSDP2's fp8 all-gather: the block's weights arrive cast (gathered_scales)


_ATTENTION = ("q_proj", "k_proj", "v_proj")


def op_block(own_items: "list[MemoryItem]", recomputed: dict[str, MemoryItem]) -> OpBlock:
    """:class:`OpBlock` for a block whose own saved items are ``own_items`` and whose compiled set without
    checkpointing is ``recomputed`` (by path inside the block). A fully checkpointed block (nothing of its own)
    re-runs and holds every linear but down_proj (its output is read by no backward node).

    * A linear whose mm the policy kept (its ``weight_scale_inv`` saved) is not re-run: its weight is cast again
      only for its input gradient, after the MLP's moments, and until then its weight's amax and inverse scale
      are held; the other scalars are read and freed by the recompute.
    * The SDPA output kept (CUDA's flash and memory-efficient kernels are on the policy's list:
      ``rules_compiled._op_attention``): o_proj's output is recomputed from it and the residual sum from that and
      the block input, without re-running the attention (compiled_op_moment.py), which waits for the attention's
      backward: the input norm, the q/k/v weights' casts and the attention's values are not held, the block's
      saved attention values (q, v, the SDPA output and log-sum-exp) and input are, and so are the scalars the
      attention's recompute and input gradients read (q/k/v's input amax and inverse scale, their weights').
    Read off the traces of the tiny Llama (one device and FSDP2; CUDA's kernel with the CPU one standing in)."""
    own = {_inner(i.name): i for i in own_items if i.category is Category.ACTIVATION}
    kept_mm = {n.split(".")[1] for n in own if n.endswith(".weight_scale_inv")}
    deferred = "self_attn.sdpa_out" in own
    mlp_and_o = ("o_proj", "gate_proj", "up_proj")
    recast = frozenset(c for c in (*_ATTENTION, *mlp_and_o) if c not in kept_mm and not (deferred and c in _ATTENTION))

    def is_held(n: str) -> bool:
        module, _, kind = n.rpartition(".")
        linear = module.split(".")[1] if "." in module else ""
        if kind in ("weight_amax", "weight_scale_inv") and linear in kept_mm and linear != "down_proj":
            return True  # read by its input gradient's weight cast
        # deferred: the attention's saved values and the scalars its recompute and input gradients read (not the
        # parameters' forward scales: replaced when the block's backward all-gather was waited on, gathered_scales)
        return deferred and n.startswith("self_attn.") and linear != "o_proj" and kind != "param_scale"

    return OpBlock(recast=recast, deferred=deferred, held=sum(i.bytes for n, i in own.items() if is_held(n)),
                   extra=sum(i.bytes for n, i in own.items() if n not in recomputed),
                   gate_amax=getattr(own.get("mlp.gate_proj.weight_amax"), "bytes", 0),
                   gathered=any(n.endswith(".weight_scale") for n in own))


def _inner(name: str) -> str:
    parts = split_block(name)
    return parts[2] if parts else name
