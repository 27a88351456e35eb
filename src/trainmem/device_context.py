"""What a training process holds on a GPU beyond the tensors of its step, itemized per GPU preset:
the CUDA context, cuBLAS's workspaces and, beyond one rank, NCCL's buffers. ``trainmem.fits``
subtracts their sum from the capacity and adds it to the ``device`` figure (nvidia-smi).

cuBLAS workspaces (``aten/src/ATen/cuda/CublasHandlePool.cpp``, PyTorch 2.13):

* ``getChosenWorkspaceSize`` → ``parseChosenWorkspaceSize``: ``CUBLAS_WORKSPACE_CONFIG`` unset, the
  default is ``:4096:2:16:8`` = 4096 KiB·2 + 16 KiB·8 = 8,519,680 B, and 32 MiB (4096 KiB·8) when the
  device's compute capability major is 9, 10 or 12 (Hopper, Blackwell). On ROCm
  (``HIPBLAS_WORKSPACE_CONFIG``): 32 MiB, 128 MiB on gfx94x/gfx95x.
* One workspace per (cuBLAS handle, stream): ``setCublasWorkspace`` / ``setWorkspaceForHandle``
  keyed by ``cublas_handle_stream_to_workspace``, allocated with
  ``c10::cuda::CUDACachingAllocator::get()->allocate`` and never freed. Handles are per thread
  (``DeviceThreadHandlePool::PoolWindow``, ``thread_local``), and a training step runs its matmuls on
  two threads: forward on the caller's, backward on autograd's device thread
  (``torch/csrc/autograd/engine.cpp``, ``Engine::start_device_threads``): two workspaces.
* cuBLASLt: with ``TORCH_CUBLASLT_UNIFIED_WORKSPACE`` unset (the open-source default,
  ``unified_cublas_and_lt_workspaces``) ``getCUDABlasLtWorkspace`` reuses the cuBLAS allocation of
  the same handle and stream: no bytes of its own. On ROCm the pools are separate: hipBLASLt's
  workspace is 76 MiB (``parseCUDABlasLtWorkspaceSize``), per handle and stream as well.

These come from the caching allocator, so on a GPU ``max_memory_allocated`` and
``max_memory_reserved`` count them. trainmem's allocated and reserved figures model the step's own
tensors and leave them out; they are counted here instead, once: in the usable memory and the
``device`` figure.

Known limitations:
  - The CUDA context (driver, lazily loaded kernel images, library handles) is not measured by
    trainmem on any GPU; each preset states its figure and source (``cuda_context_bytes``,
    ``context_source``). ``trainmem profile`` on a GPU measures it.
  - An inference step runs one thread (one workspace); the preset's figure counts two.
  - ``CUBLAS_WORKSPACE_CONFIG`` / ``CUBLASLT_WORKSPACE_SIZE`` / ``torch.backends.cuda.cublas_workspace_size``
    set by the user are not read: the defaults are modelled.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

from trainmem.errors import SpecError

if TYPE_CHECKING:
    from trainmem.plan.hardware import GPU

__all__ = ["ContextItem", "blas_workspace_bytes", "blas_workspaces_bytes", "context_items", "BLAS_THREADS",
           "NCCL_BYTES", "check_arch"]

#: cuBLAS handles a training step uses: the caller's thread (forward) and autograd's device thread (backward)
BLAS_THREADS = 2
_CUBLAS_DEFAULT = 4096 * 1024 * 2 + 16 * 1024 * 8  # ":4096:2:16:8" = 8,519,680 B
_CUBLAS_32MIB_MAJORS = (9, 10, 12)  # Hopper, Blackwell: 4096 KiB · 8
_HIPBLAS_DEFAULT, _HIPBLAS_GFX94_95 = 32 << 20, 128 << 20
_HIPBLASLT = 76 << 20  # "Use 76 MB for hipBLASLt", its own pool on ROCm

#: Per-rank NCCL buffers when the world has more than one rank. Uncertain, an order of magnitude:
#: NCCL_BUFFSIZE is 4 MiB per channel and protocol by default (NCCL docs, environment variables),
#: and NVLink rings open up to 32 channels, so a communicator holds a few hundred MiB.
NCCL_BYTES = 256 << 20


def check_arch(arch: str) -> str:
    """``sm<major><minor>`` (``sm90``) or ``gfx<id>`` (``gfx942``)."""
    ok = (arch.startswith("sm") and arch[2:].isdigit() and len(arch) >= 4) or \
        (arch.startswith("gfx") and arch[3:].isalnum() and len(arch) > 3)
    if not ok:
        raise SpecError("arch", arch, "must be sm<compute capability> (sm90) or gfx<id> (gfx942)")
    return arch


def blas_workspace_bytes(arch: str) -> int:
    """One BLAS handle's workspaces on one stream, with ``CUBLAS_WORKSPACE_CONFIG`` unset (see the
    module docstring): cuBLAS (cuBLASLt shares it), or hipBLAS + hipBLASLt on ROCm."""
    check_arch(arch)
    if arch.startswith("gfx"):
        hipblas = _HIPBLAS_GFX94_95 if arch[3:5] in ("94", "95") else _HIPBLAS_DEFAULT
        return hipblas + _HIPBLASLT
    major = int(arch[2:-1])  # sm90 -> 9, sm100 -> 10
    return 4096 * 8 * 1024 if major in _CUBLAS_32MIB_MAJORS else _CUBLAS_DEFAULT


def blas_workspaces_bytes(arch: str) -> int:
    """A training step's: :data:`BLAS_THREADS` handles, one workspace each."""
    return BLAS_THREADS * blas_workspace_bytes(arch)


@dataclass(frozen=True, kw_only=True)
class ContextItem:
    """One part of the memory outside the step's tensors."""

    name: str
    bytes: int
    formula: str
    source: str

    def to_dict(self) -> dict:
        return asdict(self)


def _workspace_formula(arch: str) -> str:
    one = blas_workspace_bytes(arch)
    what = "hipBLAS + hipBLASLt (76 MiB) workspace" if arch.startswith("gfx") else "cuBLAS workspace (cuBLASLt shares it)"
    return f"{BLAS_THREADS} threads (forward, autograd's backward) × {one:,} B {what} on {arch}"


def context_items(gpu: GPU, gpus: int = 1) -> tuple[ContextItem, ...]:
    """The memory one rank holds beyond its step's tensors, item by item; their sum is
    :func:`trainmem.fits.context_bytes`."""
    if gpu.arch:
        items = [ContextItem(name="cuda_context", bytes=gpu.cuda_context_bytes, formula="stated per preset",
                             source=gpu.context_source),
                 ContextItem(name="blas_workspaces", bytes=blas_workspaces_bytes(gpu.arch),
                             formula=_workspace_formula(gpu.arch),
                             source="aten/src/ATen/cuda/CublasHandlePool.cpp parseChosenWorkspaceSize, "
                                    "setCublasWorkspace (caching allocator, kept for the process)")]
    else:  # a custom GPU: one figure, given or the presets' old default
        items = [ContextItem(name="context", bytes=gpu.context_bytes, formula="given",
                             source=gpu.context_source or "default 1 GiB (CUDA context and library workspaces)")]
    if gpus > 1:
        items.append(ContextItem(name="nccl_buffers", bytes=NCCL_BYTES, formula="NCCL_BUFFSIZE 4 MiB × channels × protocols",
                                 source="NCCL docs (environment variables); an order of magnitude"))
    return tuple(items)
