"""The accelerator flags every command that sizes against a GPU shares (``plan``, ``advise``,
``serve``): ``--gpu`` and its overrides, ``--reserve``, and the check of a GPU count."""

from __future__ import annotations

import argparse

from trainmem.cliargs import positive_float, positive_int
from trainmem.units import SIZE_RULE

__all__ = ["add_gpu_args", "gpu_from_args", "reserve_from_args", "check_gpus"]


def add_gpu_args(p: argparse.ArgumentParser, *, required: bool, reserved_figure: bool = False) -> None:
    """``--gpu`` (a preset or ``custom``), its memory/TFLOP/s/bandwidth/node overrides, ``--reserve``.
    ``reserved_figure``: the command compares the allocator model's reserved peak (``plan``,
    ``advise``, ``serve``: every caller today), so ``--reserve-fraction`` is an extra margin, 0 by
    default; else the share of capacity that stands for fragmentation, :class:`Reserve`'s 5%
    (a command comparing allocated peaks; none does now)."""
    from trainmem.plan.hardware import Reserve, list_gpus

    p.add_argument("--gpu", required=required, metavar="NAME",
                   help=f"accelerator preset ({', '.join(list_gpus())}) or custom")
    p.add_argument("--gpu-memory", metavar="SIZE",
                   help=f"override or set (custom) device memory, e.g. 80GiB ({SIZE_RULE})")
    p.add_argument("--gpu-tflops", type=positive_float("gpu-tflops"), metavar="T",
                   help="override or set (custom) dense bf16 TFLOP/s")
    p.add_argument("--gpu-intra-bw", metavar="SIZE", help="per-GPU intra-node bandwidth per second, e.g. 450GB "
                                                          "(GB = 10^9 bytes, G = 2^30)")
    p.add_argument("--gpu-inter-bw", metavar="SIZE", help="per-GPU inter-node bandwidth per second, e.g. 50GB "
                                                          "(GB = 10^9 bytes, G = 2^30)")
    p.add_argument("--gpus-per-node", type=positive_int("gpus-per-node"), metavar="N",
                   help="override or set (custom) the GPUs in one node")
    r = Reserve()
    p.add_argument("--reserve", default=None, metavar="SIZE",
                   help=f"memory per rank kept for the CUDA context and workspaces "
                        f"(default {r.fixed_bytes >> 30}GiB; {SIZE_RULE})")
    if reserved_figure:
        p.add_argument("--reserve-fraction", type=float, default=0.0, metavar="F",
                       help="extra margin, a share of capacity, kept free beyond the reserved peak (default 0: "
                            "the fit compares the allocator model's reserved peak with capacity − context)")
    else:
        from trainmem.fits import ESTIMATE_RESERVE_FRACTION  # an allocated peak: fragmentation not modelled
        p.add_argument("--reserve-fraction", type=float, default=ESTIMATE_RESERVE_FRACTION, metavar="F",
                       help=f"share of capacity lost to allocator fragmentation (default {ESTIMATE_RESERVE_FRACTION})")


def gpu_from_args(args: argparse.Namespace):
    """The :class:`~trainmem.plan.hardware.GPU` that ``--gpu`` and its overrides name."""
    from trainmem.plan.hardware import load_gpu, parse_size

    def size(flag, value):
        return None if value is None else parse_size(value, field=flag)

    return load_gpu(
        args.gpu,
        memory_bytes=size("gpu_memory", args.gpu_memory),
        bf16_flops=None if args.gpu_tflops is None else args.gpu_tflops * 1e12,
        intra_node_bytes_per_s=size("gpu_intra_bw", args.gpu_intra_bw),
        inter_node_bytes_per_s=size("gpu_inter_bw", args.gpu_inter_bw),
        gpus_per_node=args.gpus_per_node,
    )


def reserve_from_args(args: argparse.Namespace, gpu=None):
    """``--reserve``, else the GPU preset's own CUDA context figure (``context_bytes``, an estimate)."""
    from trainmem.plan.hardware import Reserve, parse_size

    if args.reserve is None:
        return Reserve(fraction=args.reserve_fraction) if gpu is None else \
            Reserve(fixed_bytes=gpu.context_bytes, fraction=args.reserve_fraction)
    fixed = 0 if args.reserve.strip() in ("0", "0B") else parse_size(args.reserve, field="reserve")
    return Reserve(fixed_bytes=fixed, fraction=args.reserve_fraction)


def check_gpus(gpu, gpus: int) -> None:
    """Refuse a GPU count that is not whole nodes beyond one node."""
    from trainmem.errors import SpecError

    if gpus > gpu.gpus_per_node and gpus % gpu.gpus_per_node:
        raise SpecError("gpus", gpus, f"must be a multiple of {gpu.gpus_per_node} (GPUs per {gpu.name} node) "
                                      "beyond one node")
