"""The planner's screen: every layout of the search space, priced in closed form.

For each (pp, cp, tp) dividing the GPU count, SP, ZeRO stage, optimizer offload, saved set
(attention, recompute, opt-in axes' variant) and micro-batch dividing the per-rank batch, the
per-rank allocated peak comes from :func:`~trainmem.plan.shard.rank_peak` on the saved set's two
estimator breakdowns (micro-batch 1 and 2) and the step time from :func:`~trainmem.plan.cost.step_time`.
Micro-batches are tried smallest first and a branch stops at the first that does not fit (the peak
grows with the micro-batch). Two choices the cost model can never prefer are skipped with their
reason: TP without sequence parallelism, and data parallelism without ZeRO-1.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from trainmem.errors import SpecError
from trainmem.plan.axes import Variant, refusal
from trainmem.plan.cost import CostModel, step_time
from trainmem.plan.hardware import GPU
from trainmem.plan.shard import Breakdown, StagePeak, rank_peak
from trainmem.specs import ModelSpec, ParallelSpec, StepSpec

__all__ = ["SearchSpace", "Screen", "screen", "config"]

# Dominated choices, skipped when the choice that dominates them is in the search space:
_NO_SP = ("dominated by sp=True: the same bytes move (all-gather + reduce-scatter = all-reduce) "
          "and norms, dropout and residuals are split over the TP group")
_NO_ZERO = ("dominated by zero=1: the distributed optimizer moves the same bytes (reduce-scatter + "
            "all-gather = all-reduce) and holds 1/dp of the optimizer states")


@dataclass(frozen=True, kw_only=True)
class SearchSpace:
    """What the planner may choose. Degrees not dividing the GPU count are skipped."""

    attention: tuple[str, ...] = ("flash", "mem-efficient", "eager")
    recompute: tuple[str, ...] = ("none", "selective", "full")
    tp: tuple[int, ...] = (1, 2, 4, 8, 16)
    cp: tuple[int, ...] = (1, 2, 4, 8, 16)
    pp: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64)
    zero: tuple[int, ...] = (0, 1, 2, 3)
    offload: tuple[tuple[str, ...], ...] = ((), ("optimizer",))
    sp: tuple[bool, ...] = (False, True)
    max_micro_batch: int = 64
    axes: tuple[str, ...] = ()
    """Opt-in axes searched as well (:data:`trainmem.plan.axes.AXES`: compile, float8, optimizer-impl,
    optimizer-8bit, optimizer-in-backward, offload-activations); each multiplies the saved sets."""

    def __post_init__(self) -> None:
        from trainmem.plan.axes import AXES
        for name in self.axes:
            if name not in AXES:
                raise SpecError("search", name, f"unknown axis (known: {', '.join(AXES)})")


class _P:
    """A ParallelSpec-shaped record without validation, for the inner loop."""

    __slots__ = ("dp", "tp", "sp", "cp", "pp", "microbatches", "zero", "fsdp", "fsdp_group", "offload",
                 "schedule", "virtual_stages", "layer_split")

    def __init__(self, dp, tp, sp, cp, pp, microbatches, zero, offload):
        self.dp, self.tp, self.sp, self.cp, self.pp = dp, tp, sp, cp, pp
        self.microbatches, self.zero, self.offload = microbatches, zero, offload
        self.fsdp, self.fsdp_group = None, 8
        self.schedule, self.virtual_stages, self.layer_split = "1f1b", 1, ()  # ParallelSpec's defaults

    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.cp * self.pp

    def spec(self) -> ParallelSpec:
        return ParallelSpec(dp=self.dp, tp=self.tp, sp=self.sp, cp=self.cp, pp=self.pp,
                            microbatches=self.microbatches, zero=self.zero, offload=self.offload)


def config(mb, accum, attn, rc, p: _P, variant: Variant = Variant()) -> dict:
    return {"micro_batch": mb, "grad_accum": accum, "attention": attn, "recompute": rc, "dp": p.dp,
            "tp": p.tp, "sp": p.sp, "cp": p.cp, "pp": p.pp, "schedule": "1f1b", "zero": p.zero,
            "offload": list(p.offload), **variant.config()}


def _structural(model: ModelSpec, seq: int, gpu: GPU, tp: int, cp: int, pp: int) -> str | None:
    if tp > gpu.gpus_per_node:
        return f"tp={tp} spans nodes ({gpu.gpus_per_node} GPUs per node): TP all-reduces every block"
    if model.num_heads % tp or (model.num_kv_heads % tp and tp % model.num_kv_heads):
        return f"tp={tp} does not divide {model.num_heads} heads / {model.num_kv_heads} KV heads"
    if model.ffn_size % tp:
        return f"tp={tp} does not divide ffn_size={model.ffn_size}"
    if seq % (2 * cp) and cp > 1:
        return f"cp={cp}: seq={seq} is not a multiple of 2·cp (load-balanced causal ring)"
    if pp > model.num_layers:
        return f"pp={pp} exceeds {model.num_layers} layers"
    return None


def _divisors(n: int, limit: int) -> list[int]:
    return [d for d in range(1, min(n, limit) + 1) if n % d == 0]


@dataclass
class Screen:
    """What the screen found: rows ``(step time, StagePeak, mb, accum, attention, recompute, _P,
    StepTime, Variant)`` that fit the budget, the first that did not per branch, the rejections
    (only with ``keep_rejected``) and the number of configurations priced."""

    fitting: list[tuple] = field(default_factory=list)
    closest: list[tuple] = field(default_factory=list)
    rejected: list[tuple[dict, str]] = field(default_factory=list)
    evaluated: int = 0


def screen(model: ModelSpec, *, seq: int, global_batch: int, gpu: GPU, gpus: int, space: SearchSpace,
           kernels: dict, usable: int, cost: CostModel, n_params: int, keep_rejected: bool,
           finetune=None) -> Screen:
    """Every layout of ``space`` on ``gpus`` × ``gpu``, its closed-form allocated peak against
    ``usable`` and its step time (``kernels``: :func:`~trainmem.plan.axes.saved_sets`'s)."""
    out = Screen()
    rejected, fitting, closest = out.rejected, out.fitting, out.closest
    evaluated = 0
    steps: dict[tuple, StepSpec] = {}
    scaled: dict[tuple, Breakdown] = {}
    refusals: dict[tuple, str | None] = {}  # (kernel, layout, accumulates): the axes' layout refusals, memoized

    def reject(cfg_fn, why: str) -> None:
        if keep_rejected:
            rejected.append((cfg_fn(), why))

    for pp in space.pp:
        for cp in space.cp:
            for tp in space.tp:
                if gpus % (tp * cp * pp):
                    continue
                dp = gpus // (tp * cp * pp)
                why = _structural(model, seq, gpu, tp, cp, pp)
                probe = _P(dp, tp, False, cp, pp, 1, 0, ())
                if why:
                    reject(lambda: config(None, None, None, None, probe), why)
                    continue
                if global_batch % dp:
                    reject(lambda: config(None, None, None, None, probe),
                           f"global batch {global_batch} is not divisible by dp={dp}")
                    continue
                per_rank = global_batch // dp
                mbs = [m for m in _divisors(per_rank, space.max_micro_batch)]
                for sp in space.sp:
                    if sp and tp == 1:
                        continue
                    if not sp and tp > 1 and True in space.sp:
                        reject(lambda: config(None, None, None, None, _P(dp, tp, sp, cp, pp, 1, 0, ())), _NO_SP)
                        continue
                    for zero in space.zero:
                        if zero and dp * cp == 1:
                            continue  # nothing to shard over
                        if zero == 0 and dp * cp > 1 and 1 in space.zero:
                            reject(lambda: config(None, None, None, None, _P(dp, tp, sp, cp, pp, 1, 0, ())), _NO_ZERO)
                            continue
                        for off in space.offload:
                            if off and zero == 0:
                                continue  # offload is a ZeRO feature (DeepSpeed ZeRO-Offload)
                            for (attn, rc, v), kern in kernels.items():
                                if cp > 1 and attn == "eager":
                                    reject(lambda: config(None, None, attn, rc, probe, v),
                                           f"cp={cp} needs a fused attention kernel (ring attention), not eager")
                                    continue
                                off_v = off + ("activations",) if v.offload_activations else off
                                single = dp * tp * cp * pp == 1 and not zero and not off
                                plain = v == Variant()
                                for i, mb in enumerate(mbs):
                                    accum = per_rank // mb
                                    p = _P(dp, tp, sp, cp, pp, accum, zero, off_v)
                                    if not plain:
                                        rkey = (attn, rc, v, dp, tp, sp, cp, pp, zero, off, accum > 1)
                                        if rkey not in refusals:
                                            refusals[rkey] = refusal(model, kern, p, single)
                                        if refusals[rkey]:
                                            reject(lambda: config(mb, accum, attn, rc, p, v), refusals[rkey])
                                            continue
                                    evaluated += 1
                                    if v.one_device:  # the closed form does not rebuild these phases
                                        peak, phase = kern.estimated(model, mb, accum, finetune)
                                        worst = StagePeak("rank", peak, phase, {}, 0)
                                    else:
                                        b = scaled.get((attn, rc, v, mb))
                                        if b is None:
                                            b = scaled[(attn, rc, v, mb)] = kern.b1.scaled(kern.b2, mb)
                                        stages = rank_peak(b, p, accumulate=accum > 1, detail=False)
                                        worst = max(stages, key=lambda s: s.peak_bytes)
                                    step = steps.get((mb, kern.step))
                                    if step is None:
                                        step = steps[(mb, kern.step)] = replace(kern.step, batch=mb, grad_accum=accum)
                                    t = step_time(model, step, kern.impl, p, gpu, global_batch=global_batch, cost=cost,
                                                  n_params=n_params, offloaded_activation_bytes=kern.host_bytes(mb))
                                    total = t.total_s
                                    row = (total, worst, mb, accum, attn, rc, p, t, v)
                                    if worst.peak_bytes <= usable:
                                        fitting.append(row)
                                        continue
                                    closest.append(row)
                                    reject(lambda: config(mb, accum, attn, rc, p, v),
                                           f"peak {worst.peak_bytes} B allocated ({worst.stage} stage, {worst.phase}) "
                                           f"> usable {usable} B (reserved ≥ allocated)")
                                    for mb2 in mbs[i + 1:]:  # peaks only grow with the micro-batch
                                        reject(lambda: config(mb2, per_rank // mb2, attn, rc, p, v),
                                               f"micro-batch {mb2} > {mb}, which already does not fit")
                                    break
    out.evaluated = evaluated
    return out
