"""GPU presets and sizes."""

from __future__ import annotations

import pytest

from trainmem.errors import SpecError
from trainmem.plan.hardware import GPU, Reserve, list_gpus, load_gpu, parse_size


def test_every_preset_loads_with_its_source():
    names = list_gpus()
    assert set(names) >= {"a100-40gb", "a100-80gb", "h100-80gb", "h200", "b200", "mi300x", "l4", "rtx-4090"}
    for name in names:
        gpu = load_gpu(name)
        assert gpu.memory_bytes > 16 << 30 and gpu.bf16_flops > 1e14 and gpu.source


def test_names_are_case_insensitive_and_overridable():
    assert load_gpu("H100-80GB") == load_gpu("h100-80gb")
    assert load_gpu("H200", memory_bytes=1 << 40).memory_bytes == 1 << 40


@pytest.mark.parametrize("text, nbytes", [
    ("80GiB", 80 * 2**30), ("80 GB", 80 * 10**9), ("512MiB", 512 * 2**20), ("1.5TiB", 3 * 2**39),
    ("4096B", 4096), (7, 7), ("2e3B", 2000),
])
def test_parse_size(text, nbytes):
    assert parse_size(text) == nbytes


@pytest.mark.parametrize("text", ["80GX", "", "-1GiB", "0", "GiB", "80", "4096", "1e9"])
def test_parse_size_refuses(text):
    with pytest.raises(SpecError):
        parse_size(text)


def test_unknown_gpu_suggests_the_nearest():
    with pytest.raises(SpecError, match="did you mean h100-80gb"):
        load_gpu("h100")


def test_custom_needs_memory_and_rate():
    with pytest.raises(SpecError, match="--gpu-tflops"):
        load_gpu("custom", memory_bytes=80 << 30)
    gpu = load_gpu("custom", memory_bytes=80 << 30, bf16_flops=989e12)
    assert gpu.name == "custom" and gpu.memory_bytes == 80 << 30


def test_reserve_is_fixed_plus_fraction():
    gpu = GPU(name="x", memory_bytes=100 << 30, bf16_flops=1e15, intra_node_bytes_per_s=1e11,
              inter_node_bytes_per_s=1e10)
    # 100 GiB - 1 GiB - 5 GiB = 94 GiB
    assert Reserve(fraction=0.05).usable_bytes(gpu) == 94 << 30
    # the default: the context alone, as --reserve-fraction's default 0
    assert Reserve().fraction == 0.0 and Reserve().usable_bytes(gpu) == 99 << 30
    with pytest.raises(SpecError):
        Reserve(fraction=1.5)
