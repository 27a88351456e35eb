"""The ``device`` figure's context, itemized per GPU preset (trainmem/device_context.py): the stated
CUDA context, cuBLAS's workspaces by architecture (PyTorch's CublasHandlePool.cpp defaults) and,
beyond one rank, NCCL's buffers. The allocated and reserved figures do not move with it."""

from __future__ import annotations

import json

import pytest

from trainmem.cli import main
from trainmem.device_context import BLAS_THREADS, NCCL_BYTES, blas_workspace_bytes, context_items
from trainmem.errors import SpecError
from trainmem.fits import context_bytes
from trainmem.plan.hardware import GPU, list_gpus, load_gpu

GIB, MIB = 1 << 30, 1 << 20


@pytest.mark.parametrize("arch,nbytes", [
    ("sm80", 4096 * 1024 * 2 + 16 * 1024 * 8),  # ":4096:2:16:8" = 8,519,680 B (Ampere, Ada)
    ("sm89", 8_519_680),
    ("sm90", 4096 * 8 * 1024),  # 32 MiB: compute capability major 9, 10, 12
    ("sm100", 32 * MIB),
    ("sm120", 32 * MIB),
    ("gfx942", 128 * MIB + 76 * MIB),  # hipBLAS 128 MiB on gfx94x + hipBLASLt's own 76 MiB pool
    ("gfx90a", 32 * MIB + 76 * MIB),
])
def test_one_handles_workspace_follows_pytorchs_defaults(arch, nbytes):
    assert blas_workspace_bytes(arch) == nbytes


def test_every_preset_itemizes_its_context_with_sources():
    assert BLAS_THREADS == 2  # forward on the caller's thread, backward on autograd's device thread
    for name in list_gpus():
        gpu = load_gpu(name)
        items = context_items(gpu)
        assert [i.name for i in items] == ["cuda_context", "blas_workspaces"]
        assert sum(i.bytes for i in items) == gpu.context_bytes == context_bytes(gpu)
        assert items[1].bytes == 2 * blas_workspace_bytes(gpu.arch)
        assert all(i.source for i in items) and "CublasHandlePool.cpp" in items[1].source
        eight = context_items(gpu, 8)
        assert eight[-1].name == "nccl_buffers" and context_bytes(gpu, 8) == gpu.context_bytes + NCCL_BYTES
    h100 = load_gpu("h100-80gb")
    assert (h100.arch, h100.cuda_context_bytes, h100.context_bytes) == ("sm90", GIB, GIB + 64 * MIB)
    a100 = load_gpu("a100-80gb")
    assert a100.context_bytes == GIB + 2 * 8_519_680


def test_a_custom_gpu_keeps_one_given_context():
    gpu = load_gpu("custom", memory_only=True, memory_bytes=80 * GIB)
    (item,) = context_items(gpu)
    assert (item.name, item.bytes, gpu.context_bytes) == ("context", GIB, GIB)


def test_a_bad_arch_is_named():
    with pytest.raises(SpecError, match="arch"):
        GPU(name="x", memory_bytes=80 * GIB, bf16_flops=None, intra_node_bytes_per_s=1e11,
            inter_node_bytes_per_s=1e10, arch="hopper", cuda_context_bytes=GIB)


def _json(capsys, *argv) -> dict:
    assert main([*argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_device_figure_prints_the_items_and_nothing_else_moves(capsys):
    base = ["estimate", "--model", "gpt2", "--seq", "256"]
    assert main([*base, "--gpu", "h100-80gb", "--memory-figure", "device"]) == 0
    out = capsys.readouterr().out
    assert "context = 1.00 GiB cuda_context + 64.00 MiB blas_workspaces" in out
    assert "2 threads (forward, autograd's backward) × 33,554,432 B cuBLAS workspace" in out
    fits = _json(capsys, *base, "--gpu", "h100-80gb", "--memory-figure", "device")["fits"]
    assert [i["name"] for i in fits["context_items"]] == ["cuda_context", "blas_workspaces"]
    assert fits["context_bytes"] == sum(i["bytes"] for i in fits["context_items"]) == GIB + 64 * MIB
    assert fits["need_bytes"] == fits["reserved_bytes"] + fits["context_bytes"] + fits["paged_resident_bytes"]
    # the allocated and reserved figures are the step's, whatever the GPU
    bare = _json(capsys, *base, "--memory-figure", "reserved")
    on_gpu = _json(capsys, *base, "--gpu", "a100-80gb", "--memory-figure", "reserved")
    assert bare["peak_bytes"] == on_gpu["peak_bytes"] == on_gpu["fits"]["allocated_bytes"]
    assert bare["memory_figure"] == on_gpu["memory_figure"]
