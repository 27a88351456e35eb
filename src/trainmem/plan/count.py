"""How many GPUs: the smallest count that fits, the fastest layout there, and what the next count buys.

:func:`gpu_counts` lists the counts tried: powers of two up to one node, then whole nodes in
powers of two (1, 2, 4, 8, 16, 32, ... for 8 GPUs per node), within ``[min_gpus, max_gpus]``.
:func:`smallest_fit` runs :func:`~trainmem.plan.search.plan` at each count in order until one
fits by the estimator's per-rank peak, then once more at the next count to say how much faster it
trains. The global batch stays the same at every count, so the counts are compared on one training
run.

:func:`default_global_batch` gives the global batch used when none is given: the smallest power of
two number of sequences holding at least 2^20 tokens (128 sequences of 8192, 256 of 4096). Published
pre-training runs use 0.5M-4M tokens per step (GPT-3, Brown et al. 2020, Table 2.1: 0.5M for
125M parameters up to 3.2M for 175B; Llama 2, Touvron et al. 2023: 4M); 1M is the low end of that
range for the large models people plan GPUs for, and a power of two divides any power-of-two DP.

Known limitations:
  - Counts between the powers of two (e.g. 24 or 48 GPUs) are not tried.
  - Every count is searched in full; the largest count tried bounds the time.
"""

from __future__ import annotations

from dataclasses import replace

from trainmem.errors import SpecError
from trainmem.plan.hardware import GPU
from trainmem.plan.search import Plan, plan

__all__ = ["DEFAULT_MAX_GPUS", "BATCH_TOKENS", "default_global_batch", "gpu_counts", "smallest_fit"]

DEFAULT_MAX_GPUS = 4096
BATCH_TOKENS = 1 << 20


def default_global_batch(seq: int) -> tuple[int, str]:
    """(sequences, why): the smallest power of two with at least ``BATCH_TOKENS`` tokens."""
    n = 1
    while n * seq < BATCH_TOKENS:
        n *= 2
    return n, f"default: the smallest power of two of sequences with ≥ {BATCH_TOKENS:,} tokens"


def gpu_counts(gpu: GPU, *, min_gpus: int = 1, max_gpus: int = DEFAULT_MAX_GPUS) -> list[int]:
    """The counts :func:`smallest_fit` tries, ascending."""
    for name, value in (("min_gpus", min_gpus), ("max_gpus", max_gpus)):
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise SpecError(name, value, "must be a positive integer")
    if max_gpus < min_gpus:
        raise SpecError("max_gpus", max_gpus, f"is below min_gpus={min_gpus}")
    out, n = [], 1
    while n <= max_gpus:
        if n >= min_gpus and (n <= gpu.gpus_per_node or n % gpu.gpus_per_node == 0):
            out.append(n)
        n *= 2
    if not out:
        raise SpecError("max_gpus", max_gpus, f"no power-of-two GPU count in [{min_gpus}, {max_gpus}] "
                                              f"fills whole {gpu.name} nodes of {gpu.gpus_per_node}")
    return out


def _summary(p: Plan) -> dict:
    best = p.candidates[0] if p.candidates else None
    fits = bool(best and best.fits)
    return {"gpus": p.gpus, "fits": fits,
            "tokens_per_s": best.tokens_per_s if fits else None,
            "peak_bytes": best.peak_bytes if best else None,
            "screened": p.stats["evaluated"], "screen_fit": p.stats["fitting"]}


def smallest_fit(model, *, seq: int, global_batch: int, gpu: GPU, min_gpus: int = 1,
                 max_gpus: int = DEFAULT_MAX_GPUS, top: int = 5, **kwargs) -> Plan:
    """The plan at the smallest count in :func:`gpu_counts` where a configuration fits, with
    ``gpu_counts`` listing every count tried (the next one included, for its speedup). When none
    fits, the plan at the largest count (its candidates are the closest to fitting)."""
    counts = gpu_counts(gpu, min_gpus=min_gpus, max_gpus=max_gpus)
    tried: list[dict] = []
    for i, n in enumerate(counts):
        probe = plan(model, seq=seq, global_batch=global_batch, gpu=gpu, gpus=n, top=1, front=False, **kwargs)
        tried.append(_summary(probe))
        if not tried[-1]["fits"] and n != counts[-1]:
            continue
        found = plan(model, seq=seq, global_batch=global_batch, gpu=gpu, gpus=n, top=top, **kwargs)
        if tried[-1]["fits"] and i + 1 < len(counts):
            nxt = plan(model, seq=seq, global_batch=global_batch, gpu=gpu, gpus=counts[i + 1], top=1,
                       front=False, **kwargs)
            tried.append(_summary(nxt))
        return replace(found, gpu_counts=tuple(tried))
    raise AssertionError("unreachable: the last count always returns")
