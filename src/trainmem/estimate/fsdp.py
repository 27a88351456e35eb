"""FSDP2 under pipeline parallelism: unsharded gradients (and parameters) kept across micro-batches.

torch.distributed.pipelining drives FSDP2 by hand (torch 2.13):

* ``_PipelineStageBase.backward_maybe_with_nosync`` (torch/distributed/pipelining/stage.py)
  calls ``set_is_last_backward(False)``, ``set_reshard_after_backward(False)`` and
  ``set_requires_gradient_sync(False)`` on the stage's ``FSDPModule`` before *every* micro-batch's
  backward, so ``FSDPParamGroup.post_backward`` (torch/distributed/fsdp/_fully_shard/
  _fsdp_param_group.py) neither reduce-scatters nor reshards: each parameter's gradient stays
  unsharded (``unsharded_param.grad``, accumulated by autograd micro-batch after micro-batch)
  and every block, once gathered for its backward, stays gathered;
* ``_PipelineStageBase.perform_reduce_grad``, called by the schedule's ``step`` after the last
  micro-batch (``ScheduleGPipe._step_microbatches``, ``Schedule1F1B._step_microbatches`` in
  schedules.py), turns both back on and runs every group's ``post_backward``: reshard, then one
  reduce-scatter per group into the sharded gradients.

So the sharded gradients exist only from the end of backward, and before it a stage holds its
whole unsharded gradient: ``U = Σ numel(p)/tp × grad bytes`` over the stage's trainable
parameters. With ``reshard_after_forward`` the blocks are gathered again for the first backward
and then kept: after the first micro-batch's backward all of them are unsharded.

Which micro-batch each phase describes: GPipe runs every forward first, so its first backward
holds every micro-batch's activations but only the gradients made so far (the head's and the
last block's); a 1F1B stage's later forwards and backwards hold as many activations as its first
and the whole ``U``.
"""

from __future__ import annotations

__all__ = ["pp_unsharded_working"]


def pp_unsharded_working(*, block_grads: dict[int, float], root_grads: float, first_grads: float,
                         block_params: dict[int, float], gpipe: bool,
                         reshard_after_forward: bool) -> dict[str, dict[str, float]]:
    """Per phase, the unsharded bytes a pipeline stage under FSDP2 holds beyond its shards.

    ``block_grads``/``block_params``: each block's unsharded gradient / gathered parameter bytes;
    ``root_grads``: the gradients of parameters outside blocks (the stage's root group);
    ``first_grads``: those of them produced after the blocks' backward (the token embedding);
    ``gpipe``: all forwards before any backward.
    """
    every_grad = sum(block_grads.values()) + root_grads
    last_block = max(block_grads) if block_grads else None
    head = root_grads - first_grads
    if gpipe:  # the first micro-batch's backward: the head's, then each block's gradients appear
        grads = {"forward": 0.0, "backward_start": 0.0,
                 "backward": head + (block_grads[last_block] if last_block is not None else 0),
                 "backward_first_block": every_grad - first_grads}
    else:  # 1F1B steady state: every gradient exists from the first backward on
        grads = {p: every_grad for p in ("forward", "backward_start", "backward", "backward_first_block")}
    # the end of backward: every unsharded gradient, then perform_reduce_grad's reduce-scatters
    # (the reduce-scatter buffer itself is counted with the other FSDP buffers)
    grads["backward_end"] = every_grad
    out = {p: {"fsdp_pp_unsharded_grads": v} for p, v in grads.items()}
    if reshard_after_forward:  # without it every block stays gathered all step already
        # set_reshard_after_backward(False): a block gathered for its backward stays gathered;
        # by the first block's backward (and at the end of backward) every block is
        all_blocks = sum(block_params.values())
        out["backward_first_block"]["fsdp_pp_unsharded_params"] = all_blocks
        out["backward_end"]["fsdp_pp_unsharded_params"] = all_blocks
    return out


# --- FSDP1: FlatParameter per wrapped unit ----------------------------------------------------
#
# torch.distributed.fsdp.FullyShardedDataParallel (torch/distributed/fsdp/_flat_param.py) flattens
# every parameter of a wrapped unit (a decoder block under HF/accelerate's transformer auto-wrap; the
# root takes the rest) into one FlatParameter:
#
# * FlatParamHandle._init_flat_param_and_metadata: with use_orig_params=True (align_addresses) each
#   parameter starts at a multiple of _get_aligned_numel = 16 bytes / element size, and the total is
#   padded to a multiple of the world size; frozen and trainable parameters may share the flat
#   parameter (use_orig_params=True permits non-uniform requires_grad), the dtype must be uniform;
# * FlatParamHandle.shard / _get_shard: each rank keeps one equal chunk of the flat parameter;
# * _runtime_utils._reduce_grad: the unsharded gradient is ``flat_param.grad``, the whole flat
#   parameter's (frozen parts are zeros), reduce-scattered into a new sharded gradient the size of
#   the chunk: the gradient shard covers frozen weights too;
# * FlatParamHandle._use_sharded_grad_views: the optimizer sees the original parameters as views
#   of the chunk; a trainable parameter's state is the part of it inside this rank's chunk, so the
#   optimizer states differ between ranks (the estimate gives the rank with the most).

def _aligned(total: int, align: int) -> int:
    return total + (-total) % align if align else total


def flat_layout(numels: list[int], *, world: int, align: int) -> tuple[list[int], int]:
    """(each parameter's offset, the padded flat numel) of one FlatParameter."""
    offsets, total = [], 0
    for n in numels:
        total = _aligned(total, align)
        offsets.append(total)
        total += n
    return offsets, (_aligned(total, world) if align else total)


def fsdp1_units(params: list) -> dict[str, list]:
    """The stage's parameter items grouped by wrapped unit, in flattening order: one unit per
    decoder block, the root (``""``) holding everything outside blocks."""
    from trainmem.names import split_block

    units: dict[str, list] = {}
    for p in params:
        sb = split_block(p.name)
        units.setdefault(f"{sb[0]}{sb[1]}" if sb else "", []).append(p)
    return units


def _fsdp1_layout(states: list, world: int) -> tuple[list, list]:
    """(states owned by no parameter, per unit: (name, dtype, flat numel, chunk, [(param, offset,
    numel, its other states)]))."""
    import math

    from trainmem.errors import SpecError
    from trainmem.inventory import Category, dtype_bytes

    params = [s for s in states if s.category is Category.PARAMETER]
    names = {p.name for p in params}
    by_param: dict[str | None, list] = {}
    for s in states:
        if s.category is not Category.PARAMETER:
            owner = s.name.rpartition(".")[0]
            by_param.setdefault(owner if owner in names else None, []).append(s)
    units = []
    for unit, ps in fsdp1_units(params).items():
        dtypes = {p.dtype for p in ps}
        if len(dtypes) > 1:  # _flat_param.py _validate_tensors_to_flatten: "uniform dtype"
            raise SpecError("fsdp_version", 1, f"FSDP1 flattens one dtype per unit; {unit or 'root'} mixes "
                            f"{sorted(dtypes)} (e.g. fp32 LoRA adapters on a 16-bit base): use FSDP2")
        numels = [math.prod(p.shape) for p in ps]
        offsets, flat = flat_layout(numels, world=world, align=16 // int(dtype_bytes(ps[0].dtype)))
        units.append((f"{unit}._flat_param" if unit else "_flat_param", ps[0].dtype, flat, -(-flat // world),
                      [(p, off, n, by_param.get(p.name, [])) for p, off, n in zip(ps, offsets, numels)]))
    return by_param.get(None, []), units


def _rank_items(loose: list, units: list, world: int, rank: int) -> list:
    import math

    from trainmem.inventory import Category, MemoryItem, dtype_bytes

    out = list(loose)
    for name, dtype, flat, chunk, members in units:
        lo, hi = rank * chunk, (rank + 1) * chunk
        out.append(MemoryItem.make(name, Category.PARAMETER, (chunk,), dtype, int(chunk * dtype_bytes(dtype)),
                                   f"⌈flat {flat}/{world}⌉"))
        grads = [s for *_, st in members for s in st if s.category is Category.GRADIENT]
        if grads:  # the whole flat parameter's gradient, frozen parts included
            gd = grads[0].dtype
            out.append(MemoryItem.make(f"{name}.grad", Category.GRADIENT, (chunk,), gd,
                                       int(chunk * dtype_bytes(gd)), f"⌈flat {flat}/{world}⌉ (frozen included)"))
        for _, off, n, st in members:
            inside = max(0, min(hi, off + n) - max(lo, off))
            for s in st:
                if s.category is Category.GRADIENT:
                    continue
                k = inside if math.prod(s.shape) == n else (math.prod(s.shape) if inside else 0)
                if k:
                    out.append(MemoryItem.make(s.name, s.category, (k,), s.dtype, int(k * dtype_bytes(s.dtype)),
                                               f"{k} of {n} in rank {rank}'s chunk"))
    return out


def fsdp1_rank_states(states: list, *, world: int, rank: int) -> list:
    """Rank ``rank``'s model-state items under FSDP1 (use_orig_params=True): one parameter and
    one gradient chunk per flat parameter, optimizer states for the trainable parts in the chunk."""
    return _rank_items(*_fsdp1_layout(states, world), world, rank)


def fsdp1_states(states: list, *, world: int) -> list:
    """The FSDP1 model states of the rank that holds the most bytes (ranks differ only in how
    much of the trainable parameters their chunk covers)."""
    import math

    from trainmem.inventory import Category

    loose, units = _fsdp1_layout(states, world)

    def covered(rank: int) -> int:  # optimizer/master bytes of trainable parts in the rank's chunk
        total = 0
        for _, _, _, chunk, members in units:
            lo, hi = rank * chunk, (rank + 1) * chunk
            for _, off, n, st in members:
                inside = max(0, min(hi, off + n) - max(lo, off))
                total += sum(s.bytes * inside // n for s in st
                             if s.category is not Category.GRADIENT and math.prod(s.shape) == n)
        return total

    return _rank_items(loose, units, world, max(range(world), key=covered))


def fsdp1_grad_bytes(states: list) -> dict[str, int]:
    """Unsharded gradient bytes per parameter under FSDP1: every parameter of a unit that has a
    trainable one (the flat parameter's gradient covers the frozen ones)."""
    from trainmem.inventory import Category, dtype_bytes

    params = [s for s in states if s.category is Category.PARAMETER]
    grads = {s.name.removesuffix(".grad"): s for s in states if s.category is Category.GRADIENT}
    out: dict[str, int] = {}
    for ps in fsdp1_units(params).values():
        g = next((grads[p.name] for p in ps if p.name in grads), None)
        if g is not None:
            for p in ps:
                out[p.name] = int(p.bytes / dtype_bytes(p.dtype) * dtype_bytes(g.dtype))
    return out
