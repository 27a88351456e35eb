"""FSDP2's tensors at each phase of the step, per ``fully_shard`` unit: what the estimate's phases
hold under ``--fsdp full`` with one unit per decoder block and the rest in the root.

Per unit ``u`` (the root ``R``, blocks ``0 .. L-1``), on this rank (torch 2.13,
``torch/distributed/fsdp/_fully_shard/``):

* ``gathered[u]``: the unsharded parameters, each a view of its ``all_gather_outputs`` (padded shard
  × world, ``param_dtype``: ``FSDPParam.init_all_gather_outputs``, ``_fsdp_param.py``), and the
  same size again for the flat all-gather output (``foreach_all_gather``, ``_fsdp_collectives.py``);
* ``unsharded_grads[u]``: the gradients autograd makes for the unsharded parameters (the parameters'
  own numel, ``param_dtype``), alive until the unit's ``post_backward``;
* ``rs_input[u]``: ``foreach_reduce``'s reduce-scatter input (padded numel × world, ``reduce_dtype``).
  ``FSDPParamGroup.post_backward`` frees the previous unit's before allocating its own
  (``comm_ctx.reduce_scatter_states``, ``reduce_scatter_max_input_buffers`` = 1), so exactly one is
  alive from one unit's post-backward to the next's; ``_root_post_backward_final_callback``
  (``_fsdp_state.py``) clears the last;
* ``rs_output[u]``: the sharded gradients (views of the reduce-scatter output), from the unit's
  post-backward on: the estimate's gradient items.

The phases (``reshard``: ``reshard_after_forward`` on the blocks; the root is never resharded after
forward, ``FSDPState._lazy_init``):

* ``forward`` (the loss, inside the root's forward for Hugging Face models): the root gathered, the
  last block's flat all-gather output (``wait_for_unshard`` defers its free to the next unit's
  unshard, or to the root's ``_post_forward``, which runs after the loss) and, kept, every block;
* ``backward_start`` (the loss's backward): the root's ``pre_backward`` prefetched the last block
  (``_backward_prefetch``: the unit before it in ``post_forward_order``), its flat output alive;
  kept: every block;
* ``backward`` (the last block's backward): that block gathered (its flat output freed after the
  copy-out in backward) and the flat output of the block before, prefetched by its
  ``pre_backward``; no reduce-scatter has run; the root's and this block's gradients so far are
  unsharded: autograd's, in ``param_dtype``. Kept: every block gathered (``post_backward``
  reshards each after its backward);
* ``backward_first_block``: block 0 gathered (block 0 prefetches nothing), block 1's reduce-scatter
  input, the later blocks' sharded gradients, the root's unsharded ones;
* ``backward_end`` (the embedding's backward): block 0's reduce-scatter input, every block's
  sharded gradients, the root's unsharded gradients (reduced in the final callback);
* ``optimizer``: the sharded gradients only.

Under CPU offload (``CPUOffloadPolicy``, estimate/fsdp_offload.py) the same device tensors run on the same
timeline; the sharded gradients are host figures (:func:`autograd_view` adds autograd's unsharded ones, which
the offloaded states leave out, :func:`regrade` swaps them for nothing), and a middle block's backward holds
the copies of block ``i - 1``'s shards made for its prefetched all-gather (``FSDPParam.all_gather_inputs``)
and block ``i + 1``'s reduce-scatter output shard before its copy to the host (``foreach_reduce``): both
bounds, as the ``backward`` phase's (estimate/fsdp_offload.py ``offload_transients``).

:func:`autograd_view` gives :func:`~trainmem.estimate.peak.phases` the gradients autograd makes (it
then counts the gradients made by each moment, inside a block's backward too), and
:func:`regrade` turns the units already reduce-scattered by a phase into their sharded gradients.

Known limitations: one unit per block with the root (``--fsdp-units blocks``), one micro-batch, no
pipeline, tensor, expert or context parallelism, the Float8 all-gather under compile only (torchao's Float8Linear
without ``enable_fsdp_float8_all_gather`` has plain parameters: FSDP2 gathers them as any; with it, compiled blocks:
``Units.fp8_scales``, estimate/compiled_float8_op.py), no fine-tuning,
no activation offload (:func:`applies`); elsewhere the estimate keeps its per-phase upper bounds
(estimate/parallel_buffers.py). The moment inside the root's post-backward (the root's
reduce-scatter input beside its unsharded gradients, the root resharded) is not a phase: it holds
less than the embedding's backward whenever the root's gathered parameters are at least its
reduce-scatter input (param_dtype at least as wide as reduce_dtype).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from trainmem.inventory import Category, MemoryItem, dtype_bytes
from trainmem.names import layer_of

__all__ = ["Units", "applies", "units", "working", "middle_blocks", "block_moments", "autograd_view", "regrade"]


@dataclass(frozen=True)
class Units:
    """This rank's FSDP2 units: the root and each block (keyed by block index)."""

    root_gathered: int
    gathered: dict[int, int] = field(default_factory=dict)
    unsharded_grads: dict[int, int] = field(default_factory=dict)
    rs_input: dict[int, int] = field(default_factory=dict)
    rs_output: dict[int, int] = field(default_factory=dict)
    root_unsharded_grads: int = 0
    root_rs_output: int = 0
    # CPU offload (estimate/fsdp_offload.py): the sharded gradients are host tensors, and each block's shards are
    # copied to the device before its all-gather (``h2d``) and its reduce-scatter output shard to the host (``d2h``)
    host_grads: bool = False
    h2d: dict[int, int] = field(default_factory=dict)
    d2h: dict[int, int] = field(default_factory=dict)
    # torchao's fp8 all-gather: each gathered weight's fp32 scale (fsdp_post_all_gather) stays the unsharded
    # parameter's after it reshards, until its next all-gather; the forward's are the compiled blocks' saved ones
    # (activations), so the backward's are counted from the unit's backward all-gather on (estimate/compiled_float8_op.py)
    fp8_scales: dict[int, int] = field(default_factory=dict)


def applies(par, step, impl, finetune=None) -> bool:
    """The layouts the timeline models (see the module's known limitations)."""
    from trainmem.estimate.fsdp_offload import cpu_offload

    return (bool(par.fsdp) and par.fsdp_version == 2 and impl.profile not in ("megatron", "traced")
            and par.fsdp_units == "blocks" and par.pp == 1 and par.tp == 1 and par.ep == 1 and par.cp == 1
            and max(step.grad_accum, par.microbatches) == 1 and not impl.optimizer_in_backward
            and (not impl.float8_all_gather or impl.compile)  # compiled: estimate/compiled_float8_op.py
            and finetune is None and (cpu_offload(par) or not par.offload) and "activations" not in par.offload)


def units(stage_states: list[MemoryItem], *, world: int, param_bytes: int, grad_bytes: int,
          offload: bool = False, fp8_gathered=None) -> Units:
    """Per-unit sizes from the unsharded model states; ``param_bytes``: ``param_dtype``'s element
    size, ``grad_bytes``: the sharded gradients' (``reduce_dtype``); ``offload``: FSDP2's
    ``CPUOffloadPolicy`` (the sharded gradients on the host, the shards' copies on the device)."""
    has_grad = {i.name.removesuffix(".grad") for i in stage_states if i.category is Category.GRADIENT}
    root = [0, 0, 0]  # gathered, unsharded grads, sharded grads
    blocks: dict[int, list[int]] = {}  # gathered, unsharded grads, rs input, rs output
    h2d: dict[int, int] = {}
    scales: dict[int, int] = {}
    for p in stage_states:
        if p.category is not Category.PARAMETER:
            continue
        numel = math.prod(p.shape)
        shard = math.ceil(numel / world)  # the estimate's shard (FSDP2 pads dim 0: see fsdp_streams)
        trained = p.name in has_grad
        li = layer_of(p.name)
        row = root if li is None else blocks.setdefault(li, [0, 0, 0, 0])
        # torchao's fp8 all-gather (``fp8_gathered``: estimate/compiled_float8_op.py): 1 B per element, an fp32 scale
        fp8 = fp8_gathered is not None and fp8_gathered(p)
        row[0] += shard * world * (1 if fp8 else param_bytes)
        if fp8 and li is not None:
            scales[li] = scales.get(li, 0) + 4
        row[1] += numel * param_bytes if trained else 0
        if li is None:
            row[2] += math.ceil(shard * grad_bytes) if trained else 0
        else:
            row[2] += shard * world * grad_bytes if trained else 0
            row[3] += math.ceil(shard * grad_bytes) if trained else 0
            # FSDPParam.all_gather_inputs (_fsdp_param.py): the shard copied in its stored dtype, then cast
            stored = p.bytes // numel
            h2d[li] = h2d.get(li, 0) + shard * stored + (shard * param_bytes if param_bytes != stored else 0)
    if not offload:
        h2d = {}
    return Units(root_gathered=root[0], root_unsharded_grads=root[1], root_rs_output=root[2],
                 host_grads=offload, h2d=h2d, d2h={li: r[3] for li, r in blocks.items()} if offload else {},
                 gathered={li: r[0] for li, r in blocks.items()},
                 unsharded_grads={li: r[1] for li, r in blocks.items()},
                 rs_input={li: r[2] for li, r in blocks.items()},
                 rs_output={li: r[3] for li, r in blocks.items()}, fp8_scales=scales)


def working(u: Units, *, reshard: bool) -> dict[str, dict[str, int]]:
    """FSDP2's buffers per phase (parts named as estimate/parallel_buffers.py names them:
    ``fsdp_allgather`` the blocks gathered and their flat all-gather outputs when resharded,
    ``fsdp_unsharded_params`` the blocks kept gathered, ``fsdp_reduce_scatter`` the reduce-scatter
    input alive)."""
    layers = sorted(u.gathered)
    if not layers:
        return {p: {"fsdp_root_unsharded": u.root_gathered}
                for p in ("forward", "backward_start", "backward", "backward_end")}
    first, last = layers[0], layers[-1]
    before_last = u.gathered[layers[-2]] if len(layers) > 1 else 0  # prefetched by the last block
    every = sum(u.gathered.values())
    out: dict[str, dict[str, int]] = {}
    if reshard:
        out["forward"] = {"fsdp_allgather": u.gathered[last]}
        out["backward_start"] = {"fsdp_allgather": u.gathered[last]}
        out["backward"] = {"fsdp_allgather": u.gathered[last] + before_last}
    else:
        out["forward"] = {"fsdp_unsharded_params": every, "fsdp_allgather": u.gathered[last]}
        out["backward_start"] = {"fsdp_unsharded_params": every}
        out["backward"] = {"fsdp_unsharded_params": every}
    if first != last:
        out["backward_first_block"] = {("fsdp_allgather" if reshard else "fsdp_unsharded_params"): u.gathered[first],
                                       "fsdp_reduce_scatter": u.rs_input[layers[1]]}
    out["backward_end"] = {"fsdp_reduce_scatter": u.rs_input[first]}
    for parts in out.values():
        parts["fsdp_root_unsharded"] = u.root_gathered
    if u.fp8_scales:  # resharded: the blocks gathered again in backward so far (see Units.fp8_scales); without
        # resharding the forward's scales stay the parameters' all step, beyond a block's saved set once freed
        gathered_back = ({"backward_start": layers[-1:], "backward": layers[-2:], "backward_first_block": layers,
                          "backward_end": layers} if reshard else
                         {"backward": layers[-1:], "backward_first_block": layers, "backward_end": layers})
        for phase, done in gathered_back.items():
            if phase in out:
                out[phase]["fsdp_fp8_scales"] = sum(u.fp8_scales.get(j, 0) for j in done)
    return out


def middle_blocks(u: Units, *, reshard: bool) -> dict[int, tuple[int, dict[str, int]]]:
    """The blocks strictly between the first and the last whose backward :func:`~trainmem.estimate.peak.phases`
    also takes (its ``middle_blocks``): block ``i`` -> (the gradient correction to autograd's view, FSDP2's
    buffers alive in its backward).

    A middle block's backward holds what neither end does: its own gathered parameters, the flat all-gather
    output of block ``i - 1`` that its ``pre_backward`` prefetched (``FSDPState._pre_backward`` ->
    ``_backward_prefetch``, ``_fsdp_state.py``; ``FSDPParamGroup._prefetch_unshard``, ``_fsdp_param_group.py``)
    and block ``i + 1``'s reduce-scatter input (``foreach_reduce``, ``_fsdp_collectives.py``), kept until block
    ``i``'s own ``post_backward`` frees it (``comm_ctx.reduce_scatter_states``, one buffer); the last block has
    no reduce-scatter input, the first no prefetch. Without resharding after forward no block is gathered
    again: blocks ``0 .. i`` are still gathered (``post_backward`` reshards each after its backward). The
    blocks after ``i`` hold their sharded gradients (``rs_output``), not autograd's unsharded ones.

    Live bytes are linear in ``i`` between the second block and the one before the last (one more block's
    activations or checkpoint inputs, one fewer block's sharded gradients per step), so those two bound
    every middle block: only they are returned."""
    layers = sorted(u.gathered)
    out: dict[int, tuple[int, dict[str, int]]] = {}
    for k in sorted({1, len(layers) - 2}):
        if not 0 < k < len(layers) - 1:
            continue
        li, before, after = layers[k], layers[k - 1], layers[k + 1]
        later = layers[k + 1:]
        fix = sum(_sharded(u, j) - u.unsharded_grads[j] for j in later)
        gathered = ({"fsdp_allgather": u.gathered[li] + u.gathered[before]} if reshard
                    else {"fsdp_unsharded_params": sum(u.gathered[j] for j in layers[:k + 1])})
        copies = ({"fsdp_offload_h2d": u.h2d[before], "fsdp_offload_d2h": u.d2h[after]} if u.host_grads else {})
        scales = {"fsdp_fp8_scales": sum(u.fp8_scales.get(j, 0) for j in layers[k - reshard:])} if u.fp8_scales else {}
        out[li] = (fix, {**gathered, "fsdp_reduce_scatter": u.rs_input[after], "fsdp_root_unsharded": u.root_gathered,
                         **copies, **scales})
    return out


def _sharded(u: Units, li: int) -> int:
    """Block ``li``'s sharded gradients on the device: none under CPU offload (``foreach_reduce`` copies each
    shard to the host, ``_fsdp_collectives.py``)."""
    return 0 if u.host_grads else u.rs_output[li]


def block_moments(model, impl, finetune=None) -> dict:
    """What a block's backward moments read beyond the inventory, as on one device (estimate/__init__.py):
    FSDP2's hooks run outside Dynamo (estimate/compiled_sharded.py), so a compiled block's backward is the
    one-device compiled graph's, at this rank's batch (estimate/compiled_recompute.py ``block_math``)."""
    from trainmem.estimate.compiled_recompute import block_math

    return block_math(model, eager_set=impl.compile and finetune is not None,
                      one_graph=impl.compile and impl.compile_scope == "model")


def autograd_view(items: list[MemoryItem], stage_states: list[MemoryItem], *, param_bytes: int,
                  offload: bool = False) -> list[MemoryItem]:
    """``items`` with each sharded gradient replaced by the unsharded one autograd makes
    (the parameter's numel in ``param_dtype``). Under CPU offload ``items`` hold no gradient (the sharded
    ones are host figures), yet autograd still makes the unsharded ones on the device: added from
    ``stage_states``."""
    full = {i.name: i for i in stage_states if i.category is Category.PARAMETER}
    if offload:
        items = [*items, *(i for i in stage_states if i.category is Category.GRADIENT)]
    out = []
    for it in items:
        p = full.get(it.name.removesuffix(".grad")) if it.category is Category.GRADIENT else None
        if p is None:
            out.append(it)
            continue
        numel = math.prod(p.shape)
        out.append(MemoryItem.make(it.name, it.category, p.shape, _dtype_of(param_bytes, it.dtype),
                                   numel * param_bytes, "unsharded gradient (FSDP2, before its reduce-scatter)"))
    return out


def _dtype_of(nbytes: int, fallback: str) -> str:
    return fallback if dtype_bytes(fallback) == nbytes else {2: "bfloat16", 4: "float32"}.get(nbytes, fallback)


def regrade(phases: list, u: Units) -> list:
    """The phases :func:`~trainmem.estimate.peak.phases` made from :func:`autograd_view`, with the
    units reduce-scattered by each phase holding their sharded gradients instead of autograd's."""
    layers = sorted(u.gathered)
    reduced = {"backward_first_block": layers[1:], "backward_end": layers}
    out = []
    for ph in phases:
        if ph.name == "optimizer":
            done, root = layers, True
        else:
            done, root = reduced.get(ph.name, ()), False
        drop = sum(u.unsharded_grads[li] for li in done) + (u.root_unsharded_grads if root else 0)
        add = sum(_sharded(u, li) for li in done) + (u.root_rs_output if root and not u.host_grads else 0)
        if not drop and not add:
            out.append(ph)
            continue
        parts = dict(ph.parts)
        parts["gradients"] = parts.get("gradients", 0) - drop + add
        out.append(replace(ph, parts=parts, bytes=ph.bytes - drop + add))
    return out
