"""FSDP1: one FlatParameter per wrapped unit, per rank (``--fsdp-version 1``, issue 13 mechanism 5).

``torch.distributed.fsdp.FullyShardedDataParallel`` (torch/distributed/fsdp/_flat_param.py,
_runtime_utils.py) flattens every parameter of a wrapped unit into one ``FlatParameter``:

* units: a decoder block under HF/accelerate's transformer auto-wrap, the root taking the rest
  (embedding, final norm, head). For a peft model HF Trainer replaces the policy with peft's
  ``fsdp_auto_wrap_policy`` (peft/utils/other.py; transformers ``Trainer._fsdp_qlora_plugin_updates``,
  5.x ``update_fsdp_plugin_peft``): the blocks *and* every leaf module whose weight trains, so each
  LoRA ``lora_A``/``lora_B`` Linear is a unit of its own (fp32 adapters never share a flat
  parameter with the 16-bit base, and the blocks' flat parameters are all frozen);
* ``FlatParamHandle._init_flat_param_and_metadata``: with use_orig_params=True each parameter
  starts at a multiple of ``_get_aligned_numel`` = 16 bytes / element size, the total is padded to
  a multiple of the world size; frozen and trainable parameters may share it, the dtype must be uniform
  (``_validate_tensors_to_flatten``);
* ``FlatParamHandle.shard`` / ``_get_shard``: each rank keeps one equal chunk (``_local_shard``);
* ``_runtime_utils._reduce_grad``: the unsharded gradient is ``flat_param.grad``, the whole flat
  parameter's, reduce-scattered into a new chunk-sized gradient: the gradient shard covers frozen
  weights too, for every unit holding a trainable weight. Those frozen parts are real gradients,
  not zeros: in forward the frozen weights are views of a flat parameter that requires grad, so
  autograd computes their gradients and their linears save their inputs (:func:`autograd_finetune`);
* ``FlatParamHandle._use_sharded_grad_views``: the optimizer sees the original parameters as views
  of the chunk; a trainable parameter's state is the part of it inside this rank's chunk, so the
  optimizer states differ between ranks (the estimate gives the rank with the most).

At run time (:func:`fsdp1_working`) a unit's padded unsharded flat parameter
(``FlatParamHandle.unshard`` -> ``_alloc_padded_unsharded_flat_param``: ``_full_param_padded``)
is a storage of its own beside the chunk: gathering costs the whole padded flat parameter.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["FlatUnit", "flat_layout", "fsdp1_units", "fsdp1_layout", "fsdp1_rank_states", "fsdp1_states",
           "fsdp1_grad_bytes", "fsdp1_working", "autograd_finetune"]


@dataclass(frozen=True)
class FlatUnit:
    """One wrapped unit's FlatParameter."""

    name: str  # the flat parameter's item name (``model.layers.3._flat_param``)
    dtype: str
    flat: int  # padded unsharded numel
    unpadded: int  # with the 16-byte alignment, before padding to the world size
    chunk: int  # each rank's shard (numel)
    members: tuple  # (param item, offset, numel, its other states)
    layer: int | None  # the block it lies in (None: the root)
    leaf: bool  # a unit nested in a block (peft's trainable leaf modules)
    trainable: bool


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


def _peft(params: list) -> bool:
    """A peft LoRA model: HF Trainer wraps it with peft's fsdp_auto_wrap_policy."""
    return any(".lora_A." in p.name or ".lora_B." in p.name for p in params)


def fsdp1_units(params: list, trainable: frozenset[str] = frozenset()) -> dict[str, list]:
    """The parameter items grouped by wrapped unit, in flattening order: one unit per decoder
    block, the root (``""``) holding everything outside them; for a peft model (adapter names) also
    one unit per module whose ``weight`` is in ``trainable`` (peft's lambda policy: a leaf with a
    trainable weight)."""
    from trainmem.names import split_block

    leaves = {p.name.rpartition(".")[0] for p in params
              if p.name in trainable and p.name.endswith(".weight")} if _peft(params) else set()
    units: dict[str, list] = {}
    for p in params:
        module = p.name.rpartition(".")[0]
        if module in leaves:
            key = module
        else:
            sb = split_block(p.name)
            key = f"{sb[0]}{sb[1]}" if sb else ""
        units.setdefault(key, []).append(p)
    return units


def fsdp1_layout(states: list, world: int) -> tuple[list, list[FlatUnit]]:
    """(states owned by no parameter, the flat units)."""
    from trainmem.errors import SpecError
    from trainmem.inventory import Category, dtype_bytes
    from trainmem.names import split_block

    params = [s for s in states if s.category is Category.PARAMETER]
    names = {p.name for p in params}
    by_param: dict[str | None, list] = {}
    for s in states:
        if s.category is not Category.PARAMETER:
            owner = s.name.rpartition(".")[0]
            by_param.setdefault(owner if owner in names else None, []).append(s)
    trainable = frozenset(n for n in names if any(s.category is Category.GRADIENT for s in by_param.get(n, ())))
    units = []
    for unit, ps in fsdp1_units(params, trainable).items():
        dtypes = {p.dtype for p in ps}
        if len(dtypes) > 1:  # _flat_param.py _validate_tensors_to_flatten: "uniform dtype"
            why = ("QLoRA under FSDP1 (bnb_4bit_quant_storage) is not modelled" if dtypes & {"nf4", "uint8"}
                   else "mixed dtypes need their own units (peft's wrap policy gives LoRA adapters theirs)")
            raise SpecError("fsdp_version", 1, f"FSDP1 flattens one dtype per unit; {unit or 'root'} mixes "
                            f"{sorted(dtypes)}: {why}; use FSDP2")
        numels = [math.prod(p.shape) for p in ps]
        align = 16 // int(dtype_bytes(ps[0].dtype))
        offsets, flat = flat_layout(numels, world=world, align=align)
        sb = split_block(f"{unit}.weight") if unit else None
        units.append(FlatUnit(
            name=f"{unit}._flat_param" if unit else "_flat_param", dtype=ps[0].dtype, flat=flat,
            unpadded=flat_layout(numels, world=1, align=align)[1], chunk=-(-flat // world),
            members=tuple((p, off, n, tuple(by_param.get(p.name, ()))) for p, off, n in zip(ps, offsets, numels)),
            layer=sb[1] if sb else None, leaf=bool(unit) and (sb is None or sb[2] != "weight"),
            trainable=any(p.name in trainable for p in ps)))
    return by_param.get(None, []), units


def _rank_items(loose: list, units: list[FlatUnit], world: int, rank: int) -> list:
    from trainmem.inventory import Category, MemoryItem, dtype_bytes

    out = list(loose)
    for u in units:
        lo, hi = rank * u.chunk, (rank + 1) * u.chunk
        out.append(MemoryItem.make(u.name, Category.PARAMETER, (u.chunk,), u.dtype,
                                   int(u.chunk * dtype_bytes(u.dtype)), f"⌈flat {u.flat}/{world}⌉"))
        grads = [s for *_, st in u.members for s in st if s.category is Category.GRADIENT]
        if grads:  # the whole flat parameter's gradient, frozen parts included
            gd = grads[0].dtype
            out.append(MemoryItem.make(f"{u.name}.grad", Category.GRADIENT, (u.chunk,), gd,
                                       int(u.chunk * dtype_bytes(gd)),
                                       f"⌈flat {u.flat}/{world}⌉ (frozen included)"))
        for _, off, n, st in u.members:
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
    return _rank_items(*fsdp1_layout(states, world), world, rank)


def fsdp1_states(states: list, *, world: int) -> list:
    """The FSDP1 model states of the rank that holds the most bytes (ranks differ only in how
    much of the trainable parameters their chunk covers)."""
    from trainmem.inventory import Category

    loose, units = fsdp1_layout(states, world)

    def covered(rank: int) -> int:  # optimizer/master bytes of trainable parts in the rank's chunk
        total = 0
        for u in units:
            lo, hi = rank * u.chunk, (rank + 1) * u.chunk
            for _, off, n, st in u.members:
                inside = max(0, min(hi, off + n) - max(lo, off))
                total += sum(s.bytes * inside // n for s in st
                             if s.category is not Category.GRADIENT and math.prod(s.shape) == n)
        return total

    return _rank_items(loose, units, world, max(range(world), key=covered))


def fsdp1_grad_bytes(states: list) -> dict[str, int]:
    """Unsharded gradient bytes per parameter under FSDP1: every parameter of a unit that has a
    trainable one (the flat parameter's gradient covers the frozen ones)."""
    from trainmem.inventory import dtype_bytes

    _, units = fsdp1_layout(states, 1)
    out: dict[str, int] = {}
    for u in units:
        g = next((s for *_, st in u.members for s in st if s.name.endswith(".grad")), None)
        if g is not None:
            for p, *_ in u.members:
                out[p.name] = int(p.bytes / dtype_bytes(p.dtype) * dtype_bytes(g.dtype))
    return out


def autograd_finetune(finetune, states: list, world: int):
    """The fine-tuning autograd runs under FSDP1: in forward (and its backward) a unit's parameters
    are views of its unsharded flat parameter (``FlatParamHandle._use_unsharded_views`` with
    ``as_params=False``), and that flat parameter requires grad when any of them trains, so a frozen
    weight sharing a unit with a trainable one requires grad as well: its linear saves its input and
    its gradient is computed into the flat gradient (``_use_sharded_grad_views`` then gives the
    frozen parameter none). Only units with no trainable weight stay frozen: the freeze patterns
    become those units (a block's prefix, the root's parameter names). ``finetune`` itself when
    nothing changes (adapters: peft's policy leaves every block frozen)."""
    from dataclasses import replace

    if finetune is None or finetune.mode != "full" or not finetune.freeze:
        return finetune
    frozen: list[str] = []
    for u in fsdp1_layout(states, world)[1]:
        if not u.trainable:
            unit = u.name.removesuffix("_flat_param").removesuffix(".")
            frozen.extend([unit] if unit else [p.name for p, *_ in u.members])
    return finetune if tuple(frozen) == finetune.freeze else replace(finetune, freeze=tuple(frozen))


def fsdp1_working(units: list[FlatUnit], *, gathered_bytes, grad_bytes: float,
                  reshard_after_forward: bool) -> dict[str, dict[str, float]]:
    """Per phase, the bytes one rank holds beyond its chunks: gathered flat parameters and the
    reduce-scatter's input. ``gathered_bytes(unit)``: bytes per element of the unit's gathered
    flat parameter (its own dtype; ``param_dtype`` under FSDP1 ``MixedPrecision``);
    ``grad_bytes``: of a gradient element.

    FULL_SHARD (``reshard_after_forward``), as ``_runtime_utils`` runs it with accelerate's
    ``backward_prefetch=BACKWARD_PRE``, ``forward_prefetch=False``:

    * the root is gathered by ``_root_pre_forward`` and never freed after forward
      (``_post_forward_reshard``: ``not state._is_root``): the whole padded root all step;
    * forward: one block at a time (no forward prefetch) and, inside it, one nested unit
      (a LoRA adapter: gathered in its own pre-forward, freed in its post-forward);
    * the loss backward: the root's pre-backward hook prefetches the unit that ran its forward last
      (``_get_handle_to_prefetch`` over ``_exec_order_data``'s post-forward order): the last block;
    * backward: a block and the one prefetched before it (each pre-backward hook prefetches the
      previous unit in post-forward order; a block's nested units chain the prefetch down to the
      block before it, so the block before is gathered beside one nested unit of the current
      block, the first of them in forward order: the largest is taken), or before that a block
      with two of its nested units;
    * each unit holding a trainable weight: after its backward ``_reduce_grad`` holds the whole
      unsharded ``flat_param.grad`` and, where the world size pads it, an ``F.pad`` copy
      (``_get_reduce_scatter_tensors``); the new chunk is the gradient ledger's.

    SHARD_GRAD_OP (``reshard_after_forward=False``): every unit stays gathered from its forward
    to its backward.
    """
    def g(u: FlatUnit) -> float:
        return u.flat * gathered_bytes(u)

    root = sum(g(u) for u in units if u.layer is None and not u.leaf)
    blocks: dict[int, float] = {}
    nested: dict[int | None, list[float]] = {}
    for u in units:
        if u.leaf:
            nested.setdefault(u.layer, []).append(g(u))
        elif u.layer is not None:
            blocks[u.layer] = blocks.get(u.layer, 0) + g(u)

    def inner(layer: int | None, k: int) -> float:
        return sum(sorted(nested.get(layer, []), reverse=True)[:k])

    reduce = max((u.unpadded * grad_bytes + (u.flat * grad_bytes if u.flat > u.unpadded else 0)
                  for u in units if u.trainable), default=0)
    phases = ("forward", "backward_start", "backward", "backward_end")
    if not reshard_after_forward:
        every = root + sum(blocks.values()) + sum(sum(v) for v in nested.values())
        out = {p: {"fsdp_unsharded_params": every} for p in phases}
    else:
        layers = sorted(blocks)
        fwd = max([blocks[li] + inner(li, 1) for li in layers] + [inner(None, 1)])
        bwd = max([blocks[li] + max(inner(li, 2), (blocks[layers[i - 1]] if i else 0) + inner(li, 1))
                   for i, li in enumerate(layers)] + [inner(None, 2)])
        out = {"forward": {"fsdp_root_unsharded": root, "fsdp_allgather": fwd},
               "backward_start": {"fsdp_root_unsharded": root,
                                  "fsdp_allgather": blocks[layers[-1]] if layers else 0},
               "backward": {"fsdp_root_unsharded": root, "fsdp_allgather": bwd},
               "backward_end": {"fsdp_root_unsharded": root}}
    if reduce:
        out["backward"]["fsdp_reduce_scatter"] = reduce
        out["backward_end"]["fsdp_reduce_scatter"] = reduce
    return out
