"""Plain-text report of a serving estimate: inference settings only (no optimizer, loss or gradient
ledgers), weights and KV cache per rank, the phases, and the concurrent sequences a GPU fits."""

from __future__ import annotations

from typing import TYPE_CHECKING

from trainmem.report.units import fmt_bytes

if TYPE_CHECKING:
    from trainmem.estimate.inference import Capacity, InferenceEstimate

__all__ = ["render_inference", "capacity_line", "serving_settings"]


def capacity_line(c: Capacity) -> str:
    """``fits 37 concurrent sequences of 8192 tokens on 1× H100-80GB (KV pool …, 3,348 blocks of 16 tokens)``."""
    if c.sequences == 0:
        return (f"fits no sequence of {c.context:,} tokens on {c.gpus}× {c.gpu}: {c.blocks:,} blocks of "
                f"{c.block_size} tokens left for the KV pool ({fmt_bytes(c.pool_bytes)}) after weights and activations")
    return (f"fits {c.sequences:,} concurrent sequences of {c.context:,} tokens on {c.gpus}× {c.gpu} "
            f"(KV pool {fmt_bytes(c.pool_bytes)}, {c.blocks:,} blocks of {c.block_size} tokens"
            f"{f', fewest on {c.rank}' if c.rank.startswith('stage') else ''})")


def serving_settings(e: InferenceEstimate) -> str:
    """``serving: weights=… kv_cache=… context=… …``: the inference settings, nothing of training."""
    s, sv = e.step, e.serving
    kv = next((i.dtype for i in e.inventory if i.category.value == "kv_cache"), "-")
    weights = sv.weights or f"as {s.precision} stores them"
    return (f"serving: weights={weights}{f' G={sv.weight_group}' if sv.weights == 'int4' else ''} kv_cache={kv} "
            f"context={sv.context} block={sv.block_size} sequences={s.batch} prompt={s.seq}"
            f"{f' prefill_chunk={sv.prefill_chunk}' if sv.prefill_chunk else ''} attention={e.impl.attention}")


def render_inference(e: InferenceEstimate, *, detail: bool = False) -> str:
    m, s, par = e.model, e.step, e.parallel
    lines = [
        f"trainmem estimate (inference) — {m.name} ({m.family}, {m.num_layers} layers, H={m.hidden_size}, "
        f"A={m.num_heads}/{m.num_kv_heads} kv, F={m.ffn_size}, V={m.vocab_size})",
        serving_settings(e),
        f"layout: tp={par.tp} pp={par.pp} replicas={par.dp} ({par.tp * par.pp} GPUs per replica)",
        "",
    ]
    t = e.totals_bytes
    lines.append("Per rank" if e.ranks else "Memory")
    lines.append(f"  {'rank class':<12} {'ranks':>6} {'layers':>9} {'weights':>11} {'kv_cache':>11} {'peak':>11}")
    for r in e.ranks or ():
        rt = r.totals_bytes
        lines.append(f"  {r.name:<12} {r.count:>6} {f'{r.layers[0]}-{r.layers[1] - 1}':>9} "
                     f"{fmt_bytes(rt.get('parameter', 0)):>11} {fmt_bytes(rt.get('kv_cache', 0)):>11} "
                     f"{fmt_bytes(r.peak_bytes):>11}")
    if not e.ranks:
        lines.append(f"  {'rank':<12} {1:>6} {f'0-{m.num_layers - 1}':>9} {fmt_bytes(t.get('parameter', 0)):>11} "
                     f"{fmt_bytes(t.get('kv_cache', 0)):>11} {fmt_bytes(e.peak_bytes):>11}")
    lines += ["", "Phases (live bytes" + (", the peak rank's)" if e.ranks else ")")]
    peak = e.peak
    for p in e.phases:
        lines.append(f"  {p.name:<15} {fmt_bytes(p.bytes):>12}{'  <- peak' if p is peak else ''}")
        if detail or p is peak:
            lines += [f"      {k:<22} {fmt_bytes(v):>12}" for k, v in p.parts.items()]
    where = f" on {e.peak_rank}" if e.ranks else ""
    lines += ["", f"Peak: {fmt_bytes(e.peak_bytes)} allocated{where} in phase '{e.peak_phase}' — {peak.note}"]
    if e.capacity is not None:
        lines.append(capacity_line(e.capacity))
    return "\n".join(lines)
