"""FSDP2's CPU offload on the per-tensor timeline (estimate/fsdp_timeline.py, estimate/fsdp_offload.py): the
device holds the same FSDP2 tensors as without offload, the sharded states are host figures, and a middle block's
backward adds the copies of its neighbours' shards. The real gloo runs: tests/parallel/test_fsdp_cpu_offload.py and
test_fsdp_offload_compile.py (estimate less the copies == the measured device kinds)."""

from __future__ import annotations

import pytest

from trainmem.estimate import estimate
from trainmem.estimate import fsdp_timeline as ft
from trainmem.measure_dist.worker import DEFAULT_CONFIG
from trainmem.specs import ImplSpec, ParallelSpec, StepSpec
from trainmem.specs.loaders import spec_from_hf_config

IMPL = ImplSpec(device="cpu", attention="sdpa", optimizer_impl="foreach")
BLOCK = 64 * 64 * 2 + 64 * 32 * 2 + 3 * 64 * 176 + 2 * 64  # the tiny Llama's block parameters: 46,208
STATES = ("parameters", "optimizer_states", "master_weights")


def _rank(precision: str, offload=("params",), **par):
    step = StepSpec(batch=2, seq=64, precision=precision, optimizer="adamw")
    return estimate(spec_from_hf_config(DEFAULT_CONFIG), step, IMPL,
                    ParallelSpec(dp=2, fsdp="full", offload=offload, **par)).ranks[0]


def test_the_timeline_takes_cpu_offload_not_activation_offload():
    step = StepSpec(batch=2, seq=64)
    assert ft.applies(ParallelSpec(dp=2, fsdp="full", offload=("params",)), step, IMPL)
    assert ft.applies(ParallelSpec(dp=2, fsdp="full", offload=("optimizer", "params")), step, IMPL)
    assert not ft.applies(ParallelSpec(dp=2, fsdp="full", offload=("activations", "params")), step, IMPL)
    assert not ft.applies(ParallelSpec(dp=2, fsdp="full", offload=("params",), fsdp_version=1), step, IMPL)


@pytest.mark.parametrize("precision", ["fp32", "fsdp-bf16"])
def test_forward_is_the_same_device_tensors_less_the_states(precision):
    """Before any gradient exists, the device under offload holds what it holds without offload, less the
    sharded states (host) and plus the H2D copy of a block's shards (FSDPParam.all_gather_inputs)."""
    on, off = ({p.name: p for p in r.phases} for r in (_rank(precision), _rank(precision, offload=())))
    for name in ("forward", "backward_start"):
        states = sum(off[name].parts.get(k, 0) for k in STATES)
        assert on[name].bytes - on[name].parts["fsdp_offload_h2d"] == off[name].bytes - states


def test_middle_block_holds_its_neighbours_copies():
    """Block i's backward: block i-1's shards copied in for its prefetched all-gather (fp32 stored + bf16 cast),
    block i+1's reduce-scatter output (fp32, one shard) before its D2H copy; no sharded gradient on the device."""
    u = ft.units(_state_items("fsdp-bf16"), world=2, param_bytes=2, grad_bytes=4, offload=True)
    mid = ft.middle_blocks(u, reshard=True)
    assert sorted(mid) == [1, 2]
    for li, (fix, parts) in mid.items():
        assert parts["fsdp_offload_h2d"] == BLOCK * 4 // 2 + BLOCK * 2 // 2
        assert parts["fsdp_offload_d2h"] == BLOCK * 4 // 2
        # the later blocks' unsharded gradients are gone and nothing replaces them on the device
        assert fix == -sum(u.unsharded_grads[j] for j in range(li + 1, 4))
    plain = ft.units(_state_items("fsdp-bf16"), world=2, param_bytes=2, grad_bytes=4)
    assert "fsdp_offload_h2d" not in ft.middle_blocks(plain, reshard=True)[1][1]


def _state_items(precision: str):
    from trainmem.estimate.model_states import model_state_items

    step = StepSpec(batch=2, seq=64, precision=precision, optimizer="adamw")
    return list(model_state_items(spec_from_hf_config(DEFAULT_CONFIG), step, None))


def test_sharded_gradients_are_host_figures():
    parts = {p.name: dict(p.parts) for p in _rank("fsdp-bf16").phases}
    assert parts["optimizer"]["gradients"] == 0
    assert "fsdp_root_unsharded_grads" not in parts["backward_end"]  # autograd's, counted as gradients
