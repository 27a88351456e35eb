"""Two-dimensional parallel steps in the trace: HSDP and TP + FSDP2 on a fake device mesh, as rank 0.

``trace --dp N --fsdp hybrid --fsdp-group G`` (HSDP) is ``fully_shard`` given a two-dimensional
mesh ``(dp_replicate, dp_shard) = (N / G, G)``: every parameter is sharded over the ``dp_shard``
ranks and replicated over ``dp_replicate`` (``torch/distributed/fsdp/_fully_shard/_fsdp_init.py``
``_get_mesh_info``: ``HSDPMeshInfo``); after each reduce-scatter, ``foreach_reduce``
(``_fsdp_collectives.py``) all-reduces the sharded gradient *in place* across the replicas
(``dist.all_reduce(reduce_output, group=all_reduce_group)``), no buffer of its own; the reduce
output it keeps in ``FSDPParamGroup._all_reduce_state`` until the next post-backward is the
storage the sharded gradients view, unless ``reduce_dtype`` differs from the parameters' own dtype
(then the reduce-dtype output is held beside the cast gradient until ``finalize_backward``; no
precision trainmem runs does that: fsdp-bf16 keeps fp32 parameters and reduces in fp32).

``trace --dp N --tp T --fsdp full`` (torchtitan's 2-D layout, ``ParallelDims`` /
``init_device_mesh(("dp_shard", "tp"))``, ``apply_tp`` then ``apply_fsdp`` in
torchtitan/models/llama3/infra/parallelize.py) runs :func:`trainmem.trace.parallel_tp.apply_tp` on
the ``tp`` sub-mesh, then :func:`trainmem.trace.parallel_fsdp.apply_fsdp2` on the ``dp_shard``
sub-mesh: FSDP2 shards each DTensor parameter's *local* TP shard on its dim 0
(``_fsdp_param.py`` ``FSDPParam._init_sharding_spec_tp``: a ``_StridedShard`` over dp beside the TP
placement on the concatenated ``(dp_shard, tp)`` mesh), so rank 0 holds ``⌈(d0 / T) / N⌉`` rows of
a column-cut weight and ``⌈d0 / N⌉ × d1 / T`` of a row-cut one; the all-gather runs over the
``dp_shard`` group and returns the TP-local weight. With ``--fsdp hybrid`` the mesh is
``(dp_replicate, dp_shard, tp)``. The world is the product of the degrees.

The mesh is built outside ``FakeTensorMode`` (:func:`parallel_world`). ``fully_shard`` builds more
meshes inside it (``DeviceMesh._concatenate``), whose rank tables are index arithmetic on the real
rank map: :func:`meshes_on_real_tensors` runs a ``DeviceMesh``'s construction and its ``mesh``
tensor on real CPU tensors (``unset_fake_temporarily``), as the TP trace's strided offsets do.

Known limitations: as the one-dimensional traces (trace/parallel_fsdp.py, trace/parallel_tp.py):
the fake group completes every collective at once, so buffers a real backend keeps while a
collective is in flight (gloo's, NCCL's, the all-reduce's) are not seen, and DTensor handlers'
temporaries (loss_parallel's cross-entropy) are not recorded; FSDP1 with hybrid sharding or TP,
and every other parallel dimension, are refused in one line.
"""

from __future__ import annotations

import contextlib

from trainmem.trace.parallel_fsdp import fake_world, shard_ranks

__all__ = ["is_2d", "mesh_dims", "parallel_world", "meshes_on_real_tensors", "mesh_meta",
           "mesh_line"]


def is_2d(par) -> bool:
    """Whether ``par`` asks a mesh of more than one dimension: HSDP, or TP with FSDP."""
    return par is not None and par.fsdp is not None and (par.fsdp == "hybrid" or par.tp > 1)


def mesh_dims(par) -> tuple[tuple[str, int], ...]:
    """The mesh's dimensions, outermost first, as torchtitan's ``ParallelDims`` orders them."""
    dims = []
    if par.fsdp == "hybrid":
        dims.append(("dp_replicate", par.dp // shard_ranks(par)))
    dims.append(("dp_shard", shard_ranks(par)))
    if par.tp > 1:
        dims.append(("tp", par.tp))
    return tuple(dims)


@contextlib.contextmanager
def meshes_on_real_tensors():
    """``DeviceMesh.__init__`` and ``DeviceMesh.mesh`` (torch/distributed/device_mesh.py) on real
    CPU tensors: the rank tables a mesh slices, concatenates and searches for its own coordinate
    (``_MeshLayout.remap_to_tensor``, ``_compute_coordinates_from_mesh``) are index arithmetic, no
    model data, and fake tensors cannot answer ``nonzero``."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    from torch.distributed.device_mesh import DeviceMesh

    init, mesh = DeviceMesh.__init__, DeviceMesh.__dict__["mesh"]

    def init_on_real(self, *args, **kwargs):
        with unset_fake_temporarily():
            init(self, *args, **kwargs)

    def mesh_on_real(self):
        with unset_fake_temporarily():
            return mesh.fget(self)

    DeviceMesh.__init__, DeviceMesh.mesh = init_on_real, property(mesh_on_real)
    try:
        yield
    finally:
        DeviceMesh.__init__, DeviceMesh.mesh = init, mesh


@contextlib.contextmanager
def parallel_world(par):
    """Rank 0 of the product of ``par``'s degrees in torch's fake process group, and the meshes a
    step shards over: yields ``(fsdp mesh or None, tp mesh or None)``. One-dimensional layouts get
    one mesh over every rank (:func:`trainmem.trace.parallel_fsdp.fake_world`)."""
    if not is_2d(par):
        with fake_world(par.tp if par.tp > 1 else par.dp) as mesh:
            yield (None, mesh) if par.tp > 1 else (mesh, None)
        return
    dims = mesh_dims(par)
    names = tuple(n for n, _ in dims)
    with fake_world(tuple(size for _, size in dims), names=names) as mesh, meshes_on_real_tensors():
        if par.tp == 1:  # HSDP: fully_shard on the (dp_replicate, dp_shard) mesh
            yield mesh, None
        else:  # torchtitan: the dp sub-mesh (both dims under HSDP) for fully_shard, "tp" for parallelize_module
            yield mesh[names[:-1] if len(names) > 2 else names[0]], mesh["tp"]


def mesh_meta(par) -> dict:
    """The mesh a two-dimensional trace ran on (``meta["mesh"]``)."""
    import math

    dims = mesh_dims(par)
    return {"dims": [n for n, _ in dims], "shape": [s for _, s in dims], "world_size": math.prod(s for _, s in dims),
            "rank": 0}


def mesh_line(meta: dict) -> str:
    """The mesh, in one line."""
    shape = " x ".join(f"{n}={s}" for n, s in zip(meta["dims"], meta["shape"]))
    return (f"mesh: rank 0 of {meta['world_size']} ({shape}), torch's fake process group; "
            "no collective's in-flight buffers are seen")
