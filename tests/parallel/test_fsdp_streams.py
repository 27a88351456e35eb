"""FSDP2's side-stream pools (estimate/fsdp_streams.py): the all-gather buffers on the copy-in
stream and the sharded gradients on the reduce-scatter stream, which the caching allocator keeps
apart from the default stream's blocks, so ``max_memory_reserved`` holds them beside the default
pool's peak.

The real run (slow): 2 gloo ranks, a tiny Llama ``fully_shard``-ed block by block and at the root
(tests/parallel/fsdp_streams_worker.py), every storage of the third step tagged with the stream
current when it was made; each side stream's allocations and frees equal the estimate's to the
byte, fp32 and bf16 mixed precision.
"""

from __future__ import annotations

import pytest

from trainmem.estimate import estimate
from trainmem.estimate.fsdp_streams import COPY_IN, REDUCE_SCATTER, fsdp_groups, pooled_events, side_events
from trainmem.measure_dist.worker import DEFAULT_CONFIG
from trainmem.specs import ImplSpec, ParallelSpec, StepSpec
from trainmem.specs.loaders import spec_from_hf_config

B, S = 2, 32
IMPL = ImplSpec(device="cpu", attention="sdpa", optimizer_impl="foreach")
BLOCK = 64 * 64 * 2 + 32 * 64 * 2 + 3 * 64 * 176 + 2 * 64  # 46,208 parameters
ROOT = 256 * 64 * 2 + 64  # embedding, output layer, final norm: 32,832


def _estimate(precision: str, **par):
    return estimate(spec_from_hf_config(DEFAULT_CONFIG), StepSpec(batch=B, seq=S, precision=precision, optimizer="adamw"),
                    IMPL, ParallelSpec(dp=2, fsdp="full", **par))


def _per_stream(events: list[tuple]) -> dict[str, list[tuple[str, int]]]:
    """Side events as each stream sees them: ``(alloc|free, bytes)`` in order."""
    sizes, out = {}, {}
    for e in events:
        if e[0] == "alloc":
            sizes[e[1]] = (e[3], e[2])
        pool, n = sizes[e[1]]
        out.setdefault(pool, []).append((e[0], n))
    return out


def _estimated(precision: str) -> dict[str, list[tuple[str, int]]]:
    side = side_events(fsdp_groups(_estimate(precision)))
    return _per_stream([*side["forward"], *side["forward_end"], *(e for ev in side["backward"].values() for e in ev)])


@pytest.mark.parametrize("precision,el", [("fp32", 4), ("fsdp-bf16", 2)])
def test_groups_by_formula(precision, el):
    root, *blocks = fsdp_groups(_estimate(precision))
    assert root.name == "root" and [b.name for b in blocks] == [f"layers.{i}" for i in range(4)]
    # 2 ranks: each holds half of every parameter; the all-gather output is the whole group in
    # param_dtype, its input this rank's half cast to it (none when the shard is already in it)
    assert (root.output_bytes, blocks[0].output_bytes) == (ROOT * el, BLOCK * el)
    assert (root.input_bytes, blocks[0].input_bytes) == ((ROOT // 2 * el, BLOCK // 2 * el) if el == 2 else (0, 0))
    # the reduce-scatter output: this rank's half of the gradients in the reduce dtype (fp32)
    assert (root.grad_bytes, blocks[0].grad_bytes) == (ROOT // 2 * 4, BLOCK // 2 * 4)
    assert not root.resharded and all(b.resharded for b in blocks)


def test_pools_tag_events():
    est = _estimate("fsdp-bf16")
    from trainmem.estimate.allocation_order import allocation_events

    ev = pooled_events(est, allocation_events(est))
    grads = [e for e in ev if e[0] == "alloc" and e[3] == REDUCE_SCATTER]
    # one block per group, in backward order (the root's, with the embedding's gradient, last)
    assert [e[1][1] for e in grads] == ["layers.3", "layers.2", "layers.1", "layers.0", "root"]
    assert sum(e[2] for e in grads) == (ROOT + 4 * BLOCK) // 2 * 4
    assert not any(e[0] == "alloc" and e[3] == 0 and str(e[1]).endswith(".grad") for e in ev)
    # separate embedding and head units: the head is gathered again first in backward (with the
    # loss's backward), the embedding last; the root holds nothing
    units = _estimate("fsdp-bf16", fsdp_units="blocks+embed+head")
    order = [e[1][2] for e in pooled_events(units, allocation_events(units))
             if e[0] == "alloc" and e[3] == COPY_IN and e[1][1] == 1 and e[1][3] == "output"]
    assert order == ["head", "layers.3", "layers.2", "layers.1", "layers.0", "embed"]
    # a non-FSDP estimate stays on the default pool, event for event
    single = estimate(spec_from_hf_config(DEFAULT_CONFIG), StepSpec(batch=B, seq=S, optimizer="adamw"), IMPL)
    assert {e[3] for e in pooled_events(single, allocation_events(single)) if e[0] == "alloc"} == {0}


@pytest.mark.slow  # one torchrun launch, ~70 s on 2 shared cores
@pytest.mark.distributed
def test_side_streams_match_real_fsdp2():
    pytest.importorskip("torch.distributed.fsdp")
    from torchrun_scripts import launch

    scenarios = {p: {"config": DEFAULT_CONFIG, "bf16": p == "fsdp-bf16", "batch": B, "seq": S}
                 for p in ("fp32", "fsdp-bf16")}
    got = launch("fsdp_streams_worker.py", scenarios)
    for precision, ranks in got.items():
        want = _estimated(precision)
        for r in ranks:
            # FSDP2's own buffers are torch.empty (the comm's allocate, the flat cast input); gloo's
            # reduce-scatter makes a copy of its input inside the collective (an aten.split output
            # on the reduce-scatter stream), which NCCL makes outside PyTorch's allocator: left out
            real: dict[str, list[tuple[str, int]]] = {}
            for kind, stream, op, n in r["events"]:
                if op == "aten.empty.memory_format":
                    real.setdefault(stream, []).append((kind, n))
            assert set(real) == {COPY_IN, REDUCE_SCATTER}, (precision, set(real))
            for stream in (COPY_IN, REDUCE_SCATTER):
                # every allocation and every free, in order and to the byte; how a free interleaves
                # with the next prefetch's allocation varies between runs (gloo's work thread drops
                # its reference to the buffer when it finishes: seen once in a clean-clone run at
                # 68e00ae, one free after the next all-gather's allocation on the copy-in stream)
                for kind in ("alloc", "free"):
                    assert ([n for k, n in real[stream] if k == kind]
                            == [n for k, n in want[stream] if k == kind]), (precision, stream, kind)
