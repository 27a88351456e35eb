"""Accelerators as data: memory, dense bf16 rate, link bandwidths, GPUs per node; and sizes in units.

A preset is ``trainmem/data/gpus/<name>.json``; each file names its sources. Bandwidths are per GPU
and per direction (what one rank can push into a ring): NVLink/Infinity Fabric inside a node, the
NIC across nodes, PCIe to host memory.

Known limitations:
  - Memory is the capacity the driver reports where known, else the datasheet figure.
  - Rates are datasheet peaks; the planner scales them by an MFU assumption, not by measurement.
"""

from __future__ import annotations

import difflib
import json
from dataclasses import dataclass, fields, replace
from importlib.resources import files

from trainmem.errors import ConfigError, SpecError
from trainmem import validate as v
from trainmem.units import parse_size

__all__ = ["GPU", "Reserve", "list_gpus", "load_gpu", "parse_size"]



@dataclass(frozen=True, kw_only=True)
class GPU:
    """One accelerator type and the node it sits in."""

    name: str
    """Display name (``H100-80GB``)."""
    memory_bytes: int
    """Device memory capacity."""
    bf16_flops: float | None
    """Dense BF16 tensor-core rate, FLOP/s (datasheet peak, no sparsity); None for a custom GPU
    asked memory-only questions (``plan`` needs it)."""
    fp8_flops: float | None = None
    """Dense FP8 tensor-core rate, FLOP/s (datasheet peak, no sparsity); None where the preset
    states none (A100: no fp8 tensor cores): Float8 training is offered only where it is set."""
    intra_node_bytes_per_s: float
    """Per-GPU, per-direction bandwidth to peers in the node (NVLink, Infinity Fabric, PCIe)."""
    inter_node_bytes_per_s: float
    """Per-GPU, per-direction bandwidth to other nodes (the GPU's share of the NICs)."""
    host_bytes_per_s: float = 25e9
    """Per-GPU bandwidth to host memory (PCIe), for offload."""
    gpus_per_node: int = 8
    """GPUs sharing the fast intra-node links."""
    source: str = ""
    """Where the numbers come from."""
    context_bytes: int = 1 << 30
    """Device memory a training process holds beyond its step's tensors (trainmem.device_context):
    for a preset, ``cuda_context_bytes`` + the BLAS workspaces of ``arch``; given (default 1 GiB) for
    a custom GPU."""
    context_source: str = ""
    """Where ``cuda_context_bytes`` (a custom GPU: ``context_bytes``) comes from, and how sure it is."""
    arch: str = ""
    """Compute capability (``sm90``) or ROCm target (``gfx942``): the cuBLAS/hipBLAS workspace size."""
    cuda_context_bytes: int = 0
    """CUDA context, kernel images and library handles, outside the caching allocator (with ``arch``)."""

    def __post_init__(self) -> None:
        v.positive("memory_bytes", self.memory_bytes, maximum=1 << 50)
        v.positive("gpus_per_node", self.gpus_per_node, maximum=1024)
        if self.arch:  # itemized: trainmem.device_context; over a small --gpu-memory nothing fits, as it should
            from trainmem.device_context import blas_workspaces_bytes
            v.non_negative("cuda_context_bytes", self.cuda_context_bytes, maximum=self.memory_bytes)
            object.__setattr__(self, "context_bytes", self.cuda_context_bytes + blas_workspaces_bytes(self.arch))
        else:
            v.non_negative("context_bytes", self.context_bytes, maximum=self.memory_bytes)
        for name in ("bf16_flops", "fp8_flops", "intra_node_bytes_per_s", "inter_node_bytes_per_s", "host_bytes_per_s"):
            value = getattr(self, name)
            if name in ("bf16_flops", "fp8_flops") and value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
                raise SpecError(name, value, "must be a positive number")

    def to_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}


@dataclass(frozen=True, kw_only=True)
class Reserve:
    """Memory a rank cannot give to tensors: CUDA context, library workspaces (cuBLAS, NCCL) and
    allocator fragmentation. Usable = capacity − fixed_bytes − fraction × capacity. ``plan``,
    ``advise``, ``serve``, ``sweep --gpu`` and the integrations (``check_run``, the callback,
    ``largest_micro_batch``) compare the allocator model's reserved peak with it (``fraction`` then
    an explicit extra margin, 0 by default: :meth:`modelled`, :meth:`reserved_usable_bytes`, and
    ``--reserve-fraction``'s default). Where an allocated peak is compared (:meth:`usable_bytes`: an
    estimate with no allocation order, e.g. inference), pass the fragmentation share explicitly
    (``fraction=trainmem.fits.ESTIMATE_RESERVE_FRACTION``, 5%)."""

    fixed_bytes: int = 1 << 30
    """CUDA context + cuBLAS/NCCL workspaces (default 1 GiB)."""
    fraction: float = 0.0
    """Share of capacity kept free beyond the peak: an extra margin over a reserved peak, or the
    allocator's rounding and fragmentation over an allocated one (default 0, as ``--reserve-fraction``)."""

    def __post_init__(self) -> None:
        v.non_negative("reserve_bytes", self.fixed_bytes, maximum=1 << 50)
        v.probability("reserve_fraction", self.fraction)

    def usable_bytes(self, gpu: GPU) -> int:
        """For an allocated peak: capacity − fixed − fraction × capacity (the integrations' check)."""
        from trainmem.fits import usable_bytes
        return usable_bytes(gpu.memory_bytes, self.fixed_bytes, self.fraction)

    def reserved_usable_bytes(self, gpu: GPU, gpus: int = 1) -> int:
        """For a reserved peak (``plan``, ``advise``): capacity − fixed − NCCL's buffers on more
        than one rank − fraction × capacity, the fraction then an extra margin
        (:func:`trainmem.fits.reserved_budget`)."""
        from trainmem.fits import reserved_budget
        return reserved_budget(gpu, gpus=gpus, fixed_bytes=self.fixed_bytes, extra_fraction=self.fraction)

    @classmethod
    def modelled(cls, gpu: GPU, fraction: float = 0.0) -> "Reserve":
        """``plan``'s and ``advise``'s default: the preset's context, no share for fragmentation
        (the allocator model gives the reserved peak), ``fraction`` an extra margin."""
        return cls(fixed_bytes=gpu.context_bytes, fraction=fraction)

    def to_dict(self) -> dict:
        return {"fixed_bytes": self.fixed_bytes, "fraction": self.fraction}


def _key(name: str) -> str:
    return name.strip().lower().replace("_", "-").replace(" ", "-")


def list_gpus() -> list[str]:
    """Preset names, sorted."""
    return sorted(p.name[:-5] for p in files("trainmem.data").joinpath("gpus").iterdir() if p.name.endswith(".json"))


def load_gpu(name: str, *, memory_only: bool = False, **overrides) -> GPU:
    """A preset by name (case-insensitive: ``H100-80GB``, ``h100-80gb``), with fields overridden.
    ``custom`` starts from nothing: ``memory_bytes`` is then required, and ``bf16_flops`` too
    unless ``memory_only`` (commands that ask whether a step fits, not how fast it runs); the
    bandwidths default to an H100 node's and the context to the presets' 1 GiB."""
    overrides = {k: val for k, val in overrides.items() if val is not None}
    key = _key(name)
    if key == "custom":
        flags = {"memory_bytes": "--gpu-memory", **({} if memory_only else {"bf16_flops": "--gpu-tflops"})}
        missing = [flag for f, flag in flags.items() if f not in overrides]
        if missing:
            why = "" if memory_only or missing == ["--gpu-memory"] else " (plan estimates step time)"
            raise SpecError("gpu", name, f"custom needs {' and '.join(missing)}{why}")
        base = {"intra_node_bytes_per_s": 450e9, "inter_node_bytes_per_s": 50e9, "host_bytes_per_s": 50e9,
                "bf16_flops": None}
        return GPU(name="custom", **{**base, **overrides, "source": "command line"})
    names = list_gpus()
    if key not in names:
        close = [n for n in names if n.startswith(key)] or difflib.get_close_matches(key, names, n=1, cutoff=0.4)
        hint = f"; did you mean {' or '.join(close)}?" if close else ""
        raise SpecError("gpu", name, f"unknown GPU (known: {', '.join(names)}, custom){hint}")
    path = files("trainmem.data").joinpath("gpus").joinpath(f"{key}.json")
    try:
        data = json.loads(path.read_text())
        gpu = GPU(**data)
    except (ValueError, TypeError) as exc:
        raise ConfigError(f"GPU preset {key}: {exc}") from None
    return replace(gpu, **overrides) if overrides else gpu
