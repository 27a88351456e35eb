"""FSDP2 in the trace: the real ``fully_shard`` code run in this one process, as rank 0 of N.

``trace --dp N --fsdp full`` (``trace_step(..., parallel=ParallelSpec(dp=N, fsdp="full"))``)
starts torch's fake process group (``torch/testing/_internal/distributed/fake_pg.py``:
``FakeProcessGroup`` completes every collective at once and leaves its output as it is) with
this process as rank 0 of N, builds a one-dimensional CPU device mesh over it, and shards the
model with ``fully_shard`` (``torch/distributed/fsdp/_fully_shard/_fully_shard.py``) before the
optimizer is made. Everything FSDP2 allocates then runs for real on fake tensors: the sharded
parameters (DTensors whose local shard is ``⌈dim0 / N⌉`` rows), the all-gather input and flat
output (``foreach_all_gather``, ``_fsdp_collectives.py``), the unsharded parameters (views of
each parameter's ``all_gather_outputs``, allocated and freed by ``UntypedStorage.resize_``:
``FSDPParam.alloc_all_gather_outputs`` / ``free_unsharded_param``, ``_fsdp_param.py``), the
reduce-scatter input and output (``foreach_reduce``) whose output the sharded gradients view.

Units as the estimate assumes them (``estimate/fsdp_streams.py`` ``fsdp_groups``,
``estimate/fsdp_units.py``): ``fully_shard`` on each decoder block, then on the root (the
embedding, final norm and head stay in the root, which FSDP2 never reshards after forward:
``FSDPState._lazy_init`` clears the root's ``post_forward_mesh_info``), as torchtitan's and
Hugging Face accelerate's FSDP2 wrapping do; with ``fsdp_units="blocks+embed+head"`` the token
embedding and the final norm with the output layer are units of their own, as torchtitan's
``apply_fsdp`` (torchtitan/models/llama3/infra/parallelize.py). ``precision="fsdp-bf16"`` is
``MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32)`` on every unit.

The recorder follows the in-place resizes (:func:`unsharded_storages` are registered as
resizable storages and re-read at every op, :mod:`trainmem.trace.storages`), and FSDP2's
gradients, assigned to ``.grad`` by ``foreach_reduce`` rather than accumulated by autograd, are
claimed as gradients when the optimizer step starts.

Known limitations:
  - streams are pools only: FSDP's side streams are read from ``torch.cpu.current_stream()``
    (FSDP2 and FSDP1 enter them with ``torch.cpu.stream`` on CPU) and replayed as separate pools; no events
    between streams, so a block freed on a side stream is reusable there at once;
  - rank 0's shard: with dim 0 not divisible by N the last ranks hold fewer rows (or padding
    only); rank 0 holds the most;
  - CPU offload, pipeline/context/expert parallel and ZeRO are refused in one line (HSDP and TP with
    FSDP2 run on a 2-D mesh: :mod:`trainmem.trace.parallel_2d`); FSDP1 (``--fsdp-version 1``,
    :func:`apply_fsdp1`) runs with ``FULL_SHARD``
    only: its ``SHARD_GRAD_OP`` path compares storages by ``data_ptr``, 0 on every fake tensor
    (``_flat_param.py`` ``_same_storage``), and fails; FSDP1's item names keep its
    ``_fsdp_wrapped_module.`` prefixes (what its ``named_parameters`` reports).
"""

from __future__ import annotations

import contextlib

from trainmem.errors import SpecError, UnsupportedError

__all__ = ["check_fsdp", "check_fsdp_flags", "shard_ranks", "fake_world", "apply_fsdp", "apply_fsdp1",
           "apply_fsdp2",
           "unsharded_storages", "fsdp_meta", "fsdp_line", "forget_meshes_of_other_worlds"]


def check_fsdp_flags(par) -> None:
    """Refuse, in one line, a parallel layout the FSDP2 trace does not run."""
    if par.fsdp == "hybrid" and par.dp % shard_ranks(par):  # HSDP: a mesh of two dimensions (trace/parallel_2d.py)
        raise SpecError("fsdp_group", par.fsdp_group, f"must divide the data-parallel ranks (dp={par.dp})")
    if par.fsdp_version == 1 and (par.fsdp == "hybrid" or par.tp > 1):
        what = "--fsdp hybrid" if par.fsdp == "hybrid" else f"--tp {par.tp}"
        raise UnsupportedError(f"--fsdp-version 1 with {what}: trace runs FSDP1 alone (FULL_SHARD over one mesh "
                               "dimension); estimate gives the per-rank memory")
    if par.fsdp_version == 1 and not par.reshard_after_forward:
        raise UnsupportedError("--fsdp-version 1 --no-reshard-after-forward: FSDP1's SHARD_GRAD_OP checks its views "
                               "by data_ptr (_flat_param.py _same_storage), which fake tensors lack; estimate "
                               "--fsdp-version 1 --no-reshard-after-forward gives the per-rank memory")
    if par.fsdp_version == 1 and par.fsdp_units != "blocks":
        raise UnsupportedError(f"--fsdp-units {par.fsdp_units} with --fsdp-version 1: trace wraps FSDP1 per block "
                               "(HF/accelerate's transformer auto-wrap); estimate gives the per-rank memory")
    for flag, value, single in (("cp", par.cp, 1), ("ep", par.ep, 1), ("pp", par.pp, 1), ("zero", par.zero, 0)):
        if value != single:
            raise UnsupportedError(f"--{flag} {value}: trace runs FSDP2 alone or with --tp (no other parallel "
                                   "dimension); "
                                   f"estimate --{flag} {value} gives the per-rank memory")
    if par.offload:
        what = ",".join(par.offload)
        raise UnsupportedError(f"--offload {what}: trace runs FSDP2 with shards on the device; "
                               f"estimate --offload {what} gives the per-rank memory")
    if par.dp < 2:
        raise SpecError("dp", par.dp, f"--fsdp {par.fsdp} needs --dp N, N >= 2 ranks to shard over")


def shard_ranks(par) -> int:
    """Ranks in one FSDP shard group: ``fsdp_group`` under hybrid sharding (at most ``dp``, as the
    estimate's ``shard_group``, estimate/parallel_zero.py), else every data-parallel rank."""
    return min(par.fsdp_group, par.dp) if par.fsdp == "hybrid" else par.dp


def check_fsdp(par, step, impl, finetune=None) -> None:
    """Refuse, in one line, what the FSDP trace does not run."""
    check_fsdp_flags(par)
    if finetune is not None and par.fsdp_version == 1:
        raise UnsupportedError("--finetune/--freeze with --fsdp-version 1: HF Trainer wraps a peft model with "
                               "peft's fsdp_auto_wrap_policy (each adapter a unit), which the trace does not "
                               "apply; estimate --fsdp-version 1 gives the per-rank memory")
    if impl.optimizer_in_backward:
        raise UnsupportedError("--optimizer-in-backward with --fsdp: trace steps FSDP2's sharded gradients "
                               "after backward only")


@contextlib.contextmanager
def fake_world(world: int | tuple[int, ...], names: tuple[str, ...] | None = None):
    """Rank 0 of ``world`` in torch's fake process group, and a CPU device mesh over it (``world``
    a shape: a mesh of that shape, its dimensions named ``names``, over their product); the group
    is destroyed on exit. Made outside ``FakeTensorMode`` (the mesh reads its ranks with ``tolist``)."""
    import math
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if not dist.is_available():  # pragma: no cover - torch built without distributed
        raise UnsupportedError("tracing FSDP needs torch.distributed")
    if dist.is_initialized():
        raise UnsupportedError("a torch.distributed process group is already initialised in this process; "
                               "trace FSDP starts its own fake group: call it outside your distributed job")
    shape = tuple(world) if isinstance(world, tuple) else (world,)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=math.prod(shape))
    forget_meshes_of_other_worlds()
    try:
        yield init_device_mesh("cpu", shape, mesh_dim_names=names)
    finally:
        dist.destroy_process_group()
        forget_meshes_of_other_worlds()


def forget_meshes_of_other_worlds() -> None:
    """Clear DTensor's caches of sharding decisions and redistribute plans. Their keys hold ``DeviceMesh``
    objects, which compare by rank map, layout and names (``DeviceMesh.__eq__``, torch/distributed/device_mesh.py),
    not by this process's rank or groups: a cached output spec from an earlier trace in the same process (another
    pipeline rank, another layout) carries that world's mesh, whose group names no longer resolve (the C++
    dispatch cache, ``torch._C._clear_DTensor_sharding_propagator_cache``; ``DTensor._op_dispatcher.sharding_propagator``,
    torch/distributed/tensor/_sharding_prop.py; ``_gen_transform_infos`` and the planner cache, _redistribute.py)."""
    import torch
    from torch.distributed.tensor import DTensor, _redistribute

    torch._C._clear_DTensor_sharding_propagator_cache()
    propagator = DTensor._op_dispatcher.sharding_propagator
    propagator.propagate_op_sharding.cache_clear()
    type(propagator)._propagate_tensor_meta_cached.cache_clear()
    _redistribute._gen_transform_infos.cache_clear()
    _redistribute.clear_redistribute_planner_cache()


def _blocks(model) -> list:
    """The decoder blocks: the modules whose name is the blocks' prefix and an index
    (``model.layers.3``, ``transformer.h.3``), in order."""
    from trainmem.names import layer_index

    out = []
    for name, m in model.named_modules():
        head, _, last = name.rpartition(".")
        if last.isdigit() and layer_index(name) is not None and layer_index(head) is None:
            out.append(m)
    return out


def _separate_units(model) -> tuple[list, list]:
    """The token embedding, and the final norm with the output layer, as torchtitan's ``apply_fsdp``
    wraps them (``fsdp_units="blocks+embed+head"``)."""
    from trainmem.names import is_head, is_token_embedding, layer_index

    embed = [m for n, m in model.named_modules() if n and is_token_embedding(n + ".weight")
             and not any(is_token_embedding(p + ".weight") for p in _parents(n))]
    head = [m for n, m in model.named_modules() if n and layer_index(n) is None and is_head(n + ".weight")
            and list(m.parameters(recurse=False)) and not any(is_head(p + ".weight") for p in _parents(n))]
    tied = {id(p) for m in embed[:1] for p in m.parameters()}  # a tied output layer joins the embedding's unit
    joined = [m for m in head if all(id(p) in tied for p in m.parameters(recurse=False))]
    return embed[:1] + joined, [m for m in head if m not in joined]


def _parents(name: str) -> list[str]:
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


def apply_fsdp2(model, mesh, par, step):
    """``fully_shard`` every unit of ``model`` (see the module docstring); returns the model to run
    and the number of units."""
    import torch
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from trainmem.trace.torch_state import torch_dtype

    dt = step.dtypes
    mp = (MixedPrecisionPolicy(param_dtype=torch_dtype(dt.compute), reduce_dtype=torch.float32)
          if dt.gathered else MixedPrecisionPolicy())
    blocks = _blocks(model)
    if not blocks:
        raise UnsupportedError(f"{type(model).__name__}: no decoder blocks found to shard as FSDP units")
    units = [(b, par.reshard_after_forward) for b in blocks]
    if par.fsdp_units == "blocks+embed+head":
        # torchtitan's apply_fsdp, reshard_after_forward_policy "default": the embedding as the blocks,
        # [norm, output] kept gathered after forward (its backward comes first)
        embed, head = _separate_units(model)
        units = [*((u, par.reshard_after_forward) for u in (embed,) if u), *units, *((u, False) for u in (head,) if u)]
    for unit, reshard in units:
        fully_shard(unit, mesh=mesh, reshard_after_forward=reshard, mp_policy=mp)
    # the root without reshard_after_forward, as torchtitan's apply_fsdp: left to FSDP2, which then
    # keeps the root gathered from forward to backward (FSDPState._lazy_init, _auto_reshard_after_forward)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    return model, len(units) + 1


def apply_fsdp(model, mesh, par, step):
    """Shard ``model`` as ``par.fsdp_version`` says; returns the model to run and the number of units."""
    return (apply_fsdp1 if par.fsdp_version == 1 else apply_fsdp2)(model, mesh, par, step)


def apply_fsdp1(model, mesh, par, step):
    """``FullyShardedDataParallel`` with ``use_orig_params=True``, one unit per decoder block
    (``ModuleWrapPolicy``, HF/accelerate's transformer auto-wrap) and the root, as the estimate's
    ``estimate/fsdp1_flat.py``; ``FULL_SHARD``, or ``SHARD_GRAD_OP`` under
    ``--no-reshard-after-forward``; fsdp-bf16 is ``MixedPrecision(param_dtype=bf16, reduce_dtype=fp32)``.
    Returns the wrapper (its forward runs the root's hooks) and the number of units."""
    import torch
    from torch.distributed.fsdp import FullyShardedDataParallel, MixedPrecision, ShardingStrategy
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    from trainmem.trace.torch_state import torch_dtype

    blocks = _blocks(model)
    if not blocks:
        raise UnsupportedError(f"{type(model).__name__}: no decoder blocks found to wrap as FSDP units")
    dt = step.dtypes
    mp = MixedPrecision(param_dtype=torch_dtype(dt.compute), reduce_dtype=torch.float32) if dt.gathered else None
    strategy = ShardingStrategy.FULL_SHARD if par.reshard_after_forward else ShardingStrategy.SHARD_GRAD_OP
    wrapped = FullyShardedDataParallel(model, auto_wrap_policy=ModuleWrapPolicy({type(b) for b in blocks}),
                                       use_orig_params=True, device_id=torch.device("cpu"), device_mesh=mesh,
                                       sharding_strategy=strategy, mixed_precision=mp)
    return wrapped, len(blocks) + 1


def unsharded_storages(model) -> tuple[list, list[str]]:
    """FSDP2's tensors allocated and freed by resizing their storage in place: each parameter's
    all-gather outputs (its unsharded parameter is a view of them), and the parameter names."""
    from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel

    tensors, names = [], []
    for name, m in model.named_modules():  # FSDP1: each unit's padded unsharded flat parameter and low-precision shard
        flat = m._handle.flat_param if isinstance(m, FullyShardedDataParallel) and m._handle is not None else None
        unit = name.replace("_fsdp_wrapped_module.", "").removesuffix("_fsdp_wrapped_module").rstrip(".") or "root"
        for attr in ("_full_param_padded", "_mp_shard") if flat is not None else ():
            if getattr(flat, attr, None) is not None:
                tensors.append(getattr(flat, attr))
                names.append(f"{unit}.flat_param{attr}")
    for m in model.modules():
        group = m._get_fsdp_state()._fsdp_param_group if isinstance(m, FSDPModule) else None
        for fp in group.fsdp_params if group is not None else ():
            for t in fp.all_gather_outputs:
                tensors.append(t)
                names.append(fp._param_fqn)
    return tensors, names


def fsdp_meta(par, units: int) -> dict:
    """What the result states about the sharding it ran."""
    meta = {"world_size": par.dp, "rank": 0, "version": par.fsdp_version, "units": units, "fsdp_units": par.fsdp_units,
            "reshard_after_forward": par.reshard_after_forward, "process_group": "fake"}
    if par.fsdp == "hybrid":  # HSDP (trace/parallel_2d.py): sharded within a group, replicated across groups
        meta.update(sharding="hybrid", shard_group=shard_ranks(par), replicas=par.dp // shard_ranks(par))
    return meta


def fsdp_line(meta: dict) -> str:
    """What an FSDP trace ran, in one line."""
    keep = "kept from forward to backward" if not meta["reshard_after_forward"] else "resharded after forward"
    what = "FSDP1: rank 0 of {w} (torch's fake process group), {u} flat-parameter units" if meta.get("version") == 1 \
        else "FSDP2: rank 0 of {w} (torch's fake process group), {u} fully_shard units"
    hsdp = (f"; HSDP: sharded over {meta['shard_group']} ranks, {meta['replicas']} replicas (gradients all-reduced "
            "in place)" if meta.get("sharding") == "hybrid" else "")
    return (what.format(w=meta["world_size"], u=meta["units"]) + " "
            f"({meta['fsdp_units']} + root; blocks {keep}){hsdp}; reserved: FSDP's side streams as pools of their own")
