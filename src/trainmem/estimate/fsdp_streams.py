"""FSDP2's side streams: what ``fully_shard`` allocates outside the default stream, and the
reserved memory those streams' pools add.

The CUDA caching allocator keeps one pool per stream: a block freed on one stream is never handed
to a request made on another (``c10/cuda/CUDACachingAllocator.cpp``: ``BlockPool`` orders blocks
by stream first, ``get_free_block`` stops at a block of another stream; :mod:`trainmem.trace.allocator`
models it). FSDP2 allocates two kinds of tensors on its own streams
(``torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py``; the same placement in the
``torch/distributed/_composable/fsdp`` copy of late 2024 that torchtitan's benchmarks ran):

* **all-gather copy-in stream** (``FSDPCommContext.all_gather_copy_in_stream``, used while a group
  is unsharded in forward or pre-backward, ``get_all_gather_streams``): ``foreach_all_gather``'s
  all-gather input (this rank's shards cast to ``param_dtype``: one flat buffer,
  ``_get_param_all_gather_inputs``) and the flat all-gather output (the group's padded unsharded
  size; the input is a view into it in ``all_gather_copy_in``). The input dies when
  ``foreach_all_gather`` returns. In forward the output is kept in ``comm_ctx.all_gather_state``
  until the *next* group's ``wait_for_unshard`` (after that group's output exists) and the root's
  ``_post_forward`` frees the last one; in backward it is freed right after its copy-out, before
  the next group is prefetched (``FSDPParamGroup.wait_for_unshard``, ``pre_backward``).
* **reduce-scatter stream**: ``foreach_reduce``'s output, one flat buffer per group of this rank's
  sharded gradients (reduce dtype); the parameters' ``.grad`` are views into it, so it lives until
  ``zero_grad(set_to_none=True)``. Under gradient accumulation a later micro-batch's output is
  added into the gradients and dropped.

The unsharded parameters (the copy-out targets) and the reduce-scatter *input* are allocated on
the default stream and stay in the estimate's own allocation order
(:mod:`trainmem.estimate.allocation_order`). So the sharded gradients that order allocates are
moved to the reduce-scatter pool here, as one block per group, and the all-gather buffers are
added to the copy-in pool; :func:`pooled_events` tags every event with its pool and
:func:`replay_pools` replays them through one allocator with per-stream pools. At the step's
allocated peak (the loss backward) both side pools are usually empty but reserved: that is what
they add to ``max_memory_reserved``.

Checked: tests/parallel/test_fsdp_streams.py runs a real FSDP2 step (torchrun, 2 gloo ranks; on
CPU ``torch.cpu.stream`` switches ``torch.cpu.current_stream()`` exactly where FSDP2 switches CUDA
streams) and records every storage the step makes with the stream current at that moment: the
side streams' allocation and free sequences equal :func:`side_events`' to the byte.

Known limitations:
  - shards are counted as the estimate's sharded items (``⌈numel / world⌉`` per parameter); FSDP2
    pads dim 0 to a multiple of the world size, which differs only when dim 0 does not divide;
  - torch of late 2024 cast each parameter's shard separately for the all-gather input (several
    blocks, the same bytes); the model uses today's one flat buffer;
  - HSDP is taken as FSDP: its all-reduce runs in place on the reduce-scatter output, so the
    pools are the same; a reduce dtype other than the gradients' (``_to_dtype_if_needed`` then
    makes a second, gradient-dtype copy on the same stream) is not modelled;
  - CPU offload (gradients on the host) and FSDP1 are not modelled (:func:`applies` is False);
  - no events between streams: a block freed on a side stream is reusable there at once (FSDP2
    makes the next all-gather wait for the previous copy-out, so the order holds).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Hashable

from trainmem.inventory import Category, dtype_bytes
from trainmem.names import is_head, layer_of

__all__ = ["COPY_IN", "REDUCE_SCATTER", "Group", "applies", "fsdp_groups", "side_events", "pooled_events",
           "replay_pools"]

COPY_IN = "all_gather_copy_in"
"""The pool of FSDP2's all-gather copy-in stream."""
REDUCE_SCATTER = "reduce_scatter"
"""The pool of FSDP2's reduce-scatter stream."""


@dataclass(frozen=True)
class Group:
    """One ``fully_shard`` unit on this rank: its bytes on the side streams."""

    name: str  # "root", "embed", "head" or "layers.<i>"
    layer: int | None
    input_bytes: int  # the all-gather input: this rank's shards cast to the gathered dtype (0: none made)
    output_bytes: int  # the flat all-gather output: this rank's shards × world, gathered dtype
    grad_bytes: int  # the reduce-scatter output: this rank's sharded gradients
    resharded: bool  # freed after forward, so gathered again for backward


def applies(est) -> bool:
    """FSDP2 (``fully_shard``) in the torch engine, shards on the device."""
    from trainmem.estimate.fsdp_offload import cpu_offload

    par = getattr(est, "parallel", None)
    return (par is not None and bool(par.fsdp) and par.fsdp_version == 2 and est.impl.profile != "megatron"
            and not cpu_offload(par))


def _group_of(name: str, units: str) -> tuple[str, int | None]:
    from trainmem.estimate.fsdp_units import separate_unit

    li = layer_of(name)
    if li is not None:
        return f"layers.{li}", li
    return separate_unit(name, units) or "root", None


def fsdp_groups(est) -> list[Group]:
    """This rank's FSDP2 groups in forward order (the root first: its ``pre_forward`` gathers
    before any child's; then the token embedding's unit, the blocks, the head's unit)."""
    from trainmem.estimate.float8 import gathered_bytes_per_element
    from trainmem.estimate.params import parameter_shapes
    from trainmem.estimate.parallel_zero import shard_group

    par = est.parallel
    world = shard_group(par)
    gathered = dtype_bytes(est.step.dtypes.compute)  # MixedPrecisionPolicy.param_dtype
    shapes = dict(parameter_shapes(est.model))
    acc: dict[str, list] = {}
    for it in est.inventory:
        if it.category is Category.PARAMETER:
            name = it.name
        elif it.category is Category.GRADIENT:
            name = it.name.removesuffix(".grad")
        else:
            continue
        g, li = _group_of(name, par.fsdp_units)
        row = acc.setdefault(g, [li, 0, 0, 0])  # layer, gathered, grads, input
        if it.category is Category.PARAMETER:
            per = gathered_bytes_per_element(est.impl, est.model, name, shapes.get(name, it.shape), gathered)
            row[1] += math.prod(it.shape) * per
            # the shard itself is the all-gather input when it is already in the gathered dtype
            # (FSDPParam.init_dtype_attrs drops a param_dtype equal to the shard's)
            row[3] += math.prod(it.shape) * per if per != dtype_bytes(it.dtype) else 0
        else:
            row[2] += it.bytes
    rank = {"root": -2, "embed": -1, "head": 1 << 30}
    order = sorted(acc, key=lambda g: rank.get(g, acc[g][0]))
    return [Group(g, acc[g][0], int(acc[g][3]), int(acc[g][1]) * world, int(acc[g][2]),
                  resharded=g != "root" and par.reshard_after_forward)
            for g in order if acc[g][1] or acc[g][2]]


def _gather(g: Group, step: int, free_output: bool) -> list[tuple]:
    key = ("all_gather", step, g.name)
    ev = [("alloc", (*key, "output"), g.output_bytes, COPY_IN)]
    if g.input_bytes:  # the cast shards, dead once foreach_all_gather returns
        ev = [("alloc", (*key, "input"), g.input_bytes, COPY_IN), *ev, ("free", (*key, "input"))]
    return ev + [("free", (*key, "output"))] if free_output else ev


def side_events(groups: list[Group], *, microbatches: int = 1) -> dict[str, list[tuple]]:
    """Each side stream's events for one step, ``{"forward": [...], "backward": {group: [...]},
    "forward_end": [...]}``: the all-gathers of forward (each output freed after the next group's
    exists, the last at the end of forward), each group's backward all-gather (when resharded) and
    reduce-scatter output (later micro-batches' added into the gradients and dropped)."""
    fwd: list[tuple] = []
    prev = None
    for g in groups:
        if not g.output_bytes:
            continue
        fwd += _gather(g, 0, free_output=False)
        if prev is not None:
            fwd.append(("free", ("all_gather", 0, prev, "output")))
        prev = g.name
    end = [("free", ("all_gather", 0, prev, "output"))] if prev is not None else []
    bwd: dict[str, list[tuple]] = {}
    for g in reversed(groups):
        ev = _gather(g, 1, free_output=True) if g.resharded and g.output_bytes else []
        if g.grad_bytes:
            ev.append(("alloc", ("reduce_scatter", g.name), g.grad_bytes, REDUCE_SCATTER))
            for m in range(1, microbatches):
                ev += [("alloc", ("reduce_scatter", g.name, m), g.grad_bytes, REDUCE_SCATTER),
                       ("free", ("reduce_scatter", g.name, m))]
        bwd[g.name] = ev
    return {"forward": fwd, "forward_end": end, "backward": bwd}


def pooled_events(est, events: list[tuple]) -> list[tuple]:
    """``events`` (:func:`~trainmem.estimate.allocation_order.allocation_events`) with a pool on each
    (``("alloc", key, nbytes, pool)``, ``("free", key)``): under FSDP2 the sharded gradients leave
    the default stream for the reduce-scatter pool, one block per group allocated where the group's
    last gradient was, and the all-gathers join the copy-in pool, each where its group's forward
    or backward starts. Other estimates: every event on the default pool."""
    if not applies(est):
        return [e if e[0] == "free" else (*e[:3], 0) for e in events]
    groups = fsdp_groups(est)
    side = side_events(groups, microbatches=est.step.grad_accum if est.parallel.pp == 1 else 1)
    grads = {it.name: _group_of(it.name.removesuffix(".grad"), est.parallel.fsdp_units)[0]
             for it in est.inventory if it.category is Category.GRADIENT}
    last_grad = {g: i for i, e in enumerate(events) if e[0] == "alloc" and (g := grads.get(e[1]))}
    acts = {it.name for it in est.inventory if it.category is Category.ACTIVATION}
    first_fwd = next((i for i, e in enumerate(events) if e[0] == "alloc" and e[1] in acts), 0)
    fwd_end = next((i for i, e in enumerate(events) if e[0] == "alloc" and e[1] == "logits"), first_fwd)
    bwd_start: dict[int | str, int] = {}
    for i, e in enumerate(events):
        if e[0] == "alloc" and isinstance(e[1], tuple) and e[1][0] in ("recompute", "dx"):
            bwd_start.setdefault(e[1][1], i)  # a block's index, or "head"
    at: dict[int, list[tuple]] = {}
    at.setdefault(first_fwd, []).extend(side["forward"])
    at.setdefault(fwd_end, []).extend(side["forward_end"])
    accum = any(e[0] == "alloc" and e[1] in grads for e in events[:first_fwd])
    blocks_done = 1 + max((i for i, e in enumerate(events) if isinstance(e[1], tuple) and e[1][0] == "dx"), default=-1)
    for g in groups:
        ev = side["backward"][g.name]
        gather = [e for e in ev if e[1][0] == "all_gather"]
        reduce = [e for e in ev if e[1][0] == "reduce_scatter"]
        # a block's backward starts at its recompute, the head unit's with the loss's, the others' after the blocks
        start = bwd_start.get(g.layer if g.layer is not None else g.name, blocks_done)
        at.setdefault(start, []).extend(gather)
        if accum:  # the gradients exist before the step: their blocks first, this step's outputs added and dropped
            at.setdefault(0, []).extend(reduce[:1])
            at.setdefault(start, []).extend(reduce[1:])
        else:  # reduce-scattered once the group's last gradient is made (its post-backward)
            at.setdefault(last_grad.get(g.name, start - 1) + 1, []).extend(reduce)
    out: list[tuple] = []
    for i, e in enumerate([*events, None]):
        out += at.get(i, [])
        if e is None or e[1] in grads:
            continue
        out.append(e if e[0] == "free" else (*e[:3], 0))
    return out


def replay_pools(events: list[tuple], *, expandable_segments: bool = False) -> tuple[int, int]:
    """``(reserved peak, logical peak)`` of pooled events through one allocator with a pool per
    stream (:class:`~trainmem.trace.allocator.CachingAllocator`, ``stream=``)."""
    from trainmem.trace.allocator import CachingAllocator

    alloc = CachingAllocator(expandable_segments=expandable_segments)
    sizes: dict[Hashable, int] = {}
    logical = top = reserved = 0
    for e in events:
        if e[0] == "alloc":
            alloc.malloc(e[1], e[2], stream=e[3] if len(e) > 3 else 0)
            sizes[e[1]] = e[2]
            logical += e[2]
            top = max(top, logical)
            reserved = max(reserved, alloc.reserved_bytes)
        else:
            alloc.free(e[1])
            logical -= sizes.pop(e[1])
    return reserved, top
