"""``trace --dp N --fsdp hybrid --fsdp-group G`` (HSDP): ``fully_shard`` on a (dp_replicate, dp_shard) fake
mesh as rank 0 (trace/parallel_2d.py), against FSDP2 over G ranks and the estimate.

The mechanism (torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py ``foreach_reduce``): HSDP
shards over the ``dp_shard`` dimension only, and after each reduce-scatter all-reduces the reduce
output *in place* across the replicas (``dist.all_reduce(reduce_output, group=all_reduce_group)``); the
output it then holds in ``_all_reduce_state`` is the storage the sharded gradients view (reduce dtype ==
the parameters' dtype in fp32 and fsdp-bf16). So rank 0 of HSDP (dp 4, G 2) allocates what rank 0 of
FSDP2 over 2 ranks allocates, event for event (sizes, ops, streams), and the estimate, whose shard
group is G, gives both the same per-rank figure. A real 4-rank gloo run: tests/trace/test_trace_2d_real.py.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
if not torch.distributed.is_available():  # pragma: no cover
    pytest.skip("torch.distributed is not available", allow_module_level=True)

from test_trace_2d import IMPL, LLAMA, refused, traced  # noqa: E402
from trainmem.specs import ParallelSpec, StepSpec  # noqa: E402


@pytest.mark.parametrize("argv,words", [
    (["--dp", "4", "--fsdp", "hybrid", "--fsdp-group", "3"], "fsdp_group=3: must divide"),
    (["--dp", "4", "--fsdp", "full", "--fsdp-group", "2"], "fsdp_group=2: needs --fsdp hybrid"),
    (["--dp", "4", "--fsdp", "hybrid", "--fsdp-group", "2", "--fsdp-version", "1"], "--fsdp-version 1"),
    (["--dp", "4", "--fsdp", "hybrid", "--fsdp-group", "2", "--cp", "2"], "--cp 2"),
    (["--dp", "1", "--fsdp", "hybrid"], "dp=1"),
])
def test_what_hsdp_trace_cannot_run_is_one_line(capsys, argv, words):
    assert words in refused(capsys, argv)


def _stream(result) -> list[tuple]:
    rec = result.recording
    return [(e >= 0, rec.blocks[e if e >= 0 else ~e].nbytes, rec.blocks[e if e >= 0 else ~e].op,
             rec.blocks[e if e >= 0 else ~e].stream) for e in rec.events]


@pytest.mark.slow  # 2 traces per case, ~10 s each on 2 shared cores
@pytest.mark.parametrize("precision", ["fp32", "fsdp-bf16"])
def test_hsdp_allocates_what_fsdp_over_its_shard_group_does(precision):
    from trainmem.estimate import estimate
    from trainmem.specs.loaders import spec_from_hf_config

    hsdp_par = ParallelSpec(dp=4, fsdp="hybrid", fsdp_group=2)
    hsdp, fsdp = traced(precision, hsdp_par), traced(precision, ParallelSpec(dp=2, fsdp="full"))
    assert hsdp.meta["mesh"] == {"dims": ["dp_replicate", "dp_shard"], "shape": [2, 2], "world_size": 4, "rank": 0}
    assert hsdp.meta["fsdp"]["shard_group"] == 2 and hsdp.meta["fsdp"]["replicas"] == 2
    assert _stream(hsdp) == _stream(fsdp)  # the in-place all-reduce allocates nothing
    assert [(it.name, it.category, it.bytes) for it in hsdp.items] == [
        (it.name, it.category, it.bytes) for it in fsdp.items]
    assert (hsdp.peak_logical_bytes, hsdp.peak_reserved_bytes) == (fsdp.peak_logical_bytes, fsdp.peak_reserved_bytes)
    step = StepSpec(batch=2, seq=64, precision=precision, optimizer="adamw")
    (est,) = estimate(spec_from_hf_config(LLAMA), step, IMPL, parallel=hsdp_par).ranks
    (est_fsdp,) = estimate(spec_from_hf_config(LLAMA), step, IMPL, parallel=ParallelSpec(dp=2, fsdp="full")).ranks
    assert est.peak_bytes == est_fsdp.peak_bytes and est.totals_bytes == est_fsdp.totals_bytes
    ledgers = {c: sum(it.bytes for it in hsdp.items if it.category.value == c)
               for c in ("parameter", "gradient", "optimizer_state")}
    assert ledgers == {c: est.totals_bytes[c] for c in ledgers}
    # within the FSDP2 trace's band (tests/trace/test_trace_fsdp.py): measured 1.000 fp32, 1.0005 fsdp-bf16
    assert 0.97 <= est.peak_bytes / hsdp.peak_logical_bytes <= 1.03


def test_hsdp_lines_name_the_groups_and_the_mesh():
    from trainmem.trace.parallel_2d import mesh_dims, mesh_line, mesh_meta
    from trainmem.trace.parallel_fsdp import fsdp_line, fsdp_meta

    par = ParallelSpec(dp=8, fsdp="hybrid", fsdp_group=4, tp=2)
    assert mesh_dims(par) == (("dp_replicate", 2), ("dp_shard", 4), ("tp", 2))
    assert mesh_line(mesh_meta(par)).startswith("mesh: rank 0 of 16 (dp_replicate=2 x dp_shard=4 x tp=2)")
    line = fsdp_line(fsdp_meta(par, units=3))
    assert line.startswith("FSDP2: rank 0 of 8") and "HSDP: sharded over 4 ranks, 2 replicas" in line
    # a group larger than dp shards over every rank, as the estimate's shard_group: one replica
    assert mesh_dims(ParallelSpec(dp=2, fsdp="hybrid")) == (("dp_replicate", 1), ("dp_shard", 2))
