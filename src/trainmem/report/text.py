"""Plain-text report of an estimate: ledgers, the per-layer activation breakdown with
formulas, and the phases with the peak."""

from __future__ import annotations

from typing import TYPE_CHECKING

from trainmem.inventory import LEDGERS, Category
from trainmem.names import as_block, layer_of
from trainmem.report.units import fmt_bytes

if TYPE_CHECKING:  # renderers take results; they never import the estimator
    from trainmem.estimate import Estimate

__all__ = ["render_estimate", "render_comparison", "recompute_words"]


def recompute_words(im) -> str:
    """``recompute=none``, or every-k's k and which blocks it counts from (``recompute=every-k(K=2, from=kth)``)."""
    if im.recompute != "every-k":
        return f"recompute={im.recompute}"
    start = getattr(im, "recompute_from", None)
    return f"recompute=every-k(K={im.recompute_every}{f', from={start}' if start else ''})"


def render_estimate(e: Estimate, *, detail: bool = False) -> str:
    from trainmem.report.tree import head_note
    if getattr(e, "serving", None) is not None:  # --mode inference: serving settings only
        from trainmem.report.inference_text import render_inference
        return render_inference(e, detail=detail)
    m, s, im = e.model, e.step, e.impl
    lines = [
        f"trainmem estimate — {m.name} ({m.family}, {m.num_layers} layers, H={m.hidden_size}, "
        f"A={m.num_heads}/{m.num_kv_heads} kv, F={m.ffn_size}, V={m.vocab_size}{head_note(m)})",
        f"step: B={s.batch} S={s.seq} grad_accum={s.grad_accum} precision={s.precision} "
        f"optimizer={s.optimizer} loss={s.loss}",
        f"implementation: profile={im.profile} framework={im.framework} attention={im.attention} "
        f"{recompute_words(im)} device={im.device} "
        f"optimizer_impl={e.optimizer_impl}{' in backward' if im.optimizer_in_backward else ''}"
        f"{im.compile_words()}{im.float8_words()}",
        f"precision: {s.precision_description}",
        "",
        "Ledgers (logical bytes)",
    ]
    totals = e.totals_bytes
    for c in LEDGERS:
        lines.append(f"  {c.value:<17} {fmt_bytes(totals.get(c.value, 0)):>12}")
    for extra in ("kv_cache", "buffer", "paged_optimizer_state"):
        if totals.get(extra):
            lines.append(f"  {extra:<17} {fmt_bytes(totals[extra]):>12}")
    lines.append(f"  {'sum of ledgers':<17} {fmt_bytes(sum(totals.values())):>12}   (not the peak)")
    lines.append("")
    lines += _layer_breakdown(e, detail)
    lines.append("")
    lines.append("Phases (live bytes)")
    peak = e.peak
    for p in e.phases:
        mark = "  <- peak" if p is peak else ""
        lines.append(f"  {p.name:<15} {fmt_bytes(p.bytes):>12}{mark}")
        if detail or p is peak:
            for k, v in p.parts.items():
                lines.append(f"      {k:<22} {fmt_bytes(v):>12}")
    lines.append("")
    if e.ranks:
        lines += _ranks(e)
        lines.append("")
    where = f" on {e.peak_rank}" if e.ranks else ""
    lines.append(f"Peak: {fmt_bytes(e.peak_bytes)} allocated{where} in phase '{e.peak_phase}' — {peak.note}")
    if totals.get("paged_optimizer_state"):
        lines.append(f"Paged optimizer state (CUDA unified memory, outside PyTorch's allocator, not in the peak): "
                     f"{fmt_bytes(totals['paged_optimizer_state'])}")
    if e.host is not None:
        lines.append(f"Offloaded to host (--offload activations, pinned host memory, not in the peak): "
                     f"{fmt_bytes(e.host.total())} of saved activations")
    lines += [f"Note: {n}" for n in e.notes]
    return "\n".join(lines)


def _ranks(e: Estimate) -> list[str]:
    par = e.parallel
    out = [f"Per rank (dp={par.dp} tp={par.tp}{' +sp' if par.sp else ''} cp={par.cp} ep={par.ep} pp={par.pp} "
           f"{par.schedule if par.pp > 1 else ''} zero={par.zero} fsdp={par.fsdp or '-'}"
           f"{' v1' if par.fsdp and par.fsdp_version == 1 else ''} "
           f"offload={','.join(par.offload) or '-'}; ledgers above are the peak rank's)",
           f"  {'rank class':<12} {'ranks':>6} {'layers':>9} {'params':>11} {'grads':>11} {'optim':>11} "
           f"{'acts':>11} {'buffers':>10} {'peak':>11} {'host':>10}"]
    out[1:1] = [f"  {line}" for line in _fsdp_modelled(par, e.impl.profile)]
    for r in e.ranks:
        t = r.totals_bytes
        opt = t.get("optimizer_state", 0) + t.get("master_weight", 0)
        out.append(f"  {r.name:<12} {r.count:>6} {f'{r.layers[0]}-{r.layers[1] - 1}':>9} "
                   f"{fmt_bytes(t.get('parameter', 0)):>11} {fmt_bytes(t.get('gradient', 0)):>11} "
                   f"{fmt_bytes(opt):>11} {fmt_bytes(t.get('activation', 0)):>11} "
                   f"{fmt_bytes(t.get('buffer', 0)):>10} {fmt_bytes(r.peak_bytes):>11} {fmt_bytes(r.host_bytes):>10}")
    return out


def _fsdp_modelled(par, profile: str) -> list[str]:
    """What the estimate modelled for FSDP beyond per-tensor shards (estimate/fsdp.py, fsdp1_flat.py), one line each."""
    if par.fsdp and par.fsdp_version == 1:
        return [f"FSDP1 (use_orig_params): one flat parameter per block (and per LoRA adapter under peft's wrap "
                f"policy), padded to a multiple of {par.dp * par.cp} ranks;",
                "  its gradient shard covers frozen weights; optimizer states: the rank holding most trainable "
                "weights;",
                "  the root's flat parameter gathered all step, one block in forward, two in backward (BACKWARD_PRE)"]
    if par.fsdp and par.pp > 1 and profile != "megatron":
        return [f"FSDP2 under pipelining: unsharded gradients kept across the {par.microbatches} micro-batches, "
                "reduce-scattered after the last"]
    return []


def _layer_breakdown(e: Estimate, detail: bool) -> list[str]:
    acts = [i for i in e.inventory if i.category is Category.ACTIVATION]
    layer0 = [i for i in acts if layer_of(i.name) == 0]
    per_layer: dict[int, int] = {}
    outside = 0
    for i in acts:
        li = layer_of(i.name)
        if li is None:
            outside += i.bytes
        else:
            per_layer[li] = per_layer.get(li, 0) + i.bytes
    out = [f"Activations saved for backward: {fmt_bytes(sum(per_layer.values()) + outside)} "
           f"({len(per_layer)} blocks + {fmt_bytes(outside)} outside blocks)"]
    if layer0:
        out.append(f"  block 0 ({fmt_bytes(per_layer.get(0, 0))}), per tensor:")
        for i in sorted(layer0, key=lambda i: -i.bytes):
            name = as_block(i.name, 0)
            out.append(f"    {name:<52} {str(list(i.shape)):<22} {i.dtype:<9} {fmt_bytes(i.bytes):>11}  {i.formula}")
        distinct = sorted(set(per_layer.values()))
        if len(distinct) > 1:
            out.append(f"  blocks differ: {', '.join(fmt_bytes(d) for d in distinct)}")
    others = [i for i in acts if layer_of(i.name) is None]
    if others:
        out.append("  outside blocks:")
        for i in sorted(others, key=lambda i: -i.bytes)[: None if detail else 8]:
            out.append(f"    {i.name:<52} {str(list(i.shape)):<22} {i.dtype:<9} {fmt_bytes(i.bytes):>11}  {i.formula}")
    return out


def render_tensors(c, *, detail: bool = False) -> list[str]:
    """Activations joined per tensor by key (``Comparison.tensors``): those that differ, all with ``detail``."""
    rows = [r for r in c.tensors if detail or not r.equal]
    lines = ["Activations per tensor, joined by key (module : bytes : k-th kept tensor of that size it made)",
             f"  {'key':<40} {'estimate':>10} {'trace':>10}  names (estimate / trace)"]
    for r in rows:
        e, t = r.estimate, r.trace
        lines.append(f"  {r.key:<40} {fmt_bytes(e.bytes) if e else '-':>10} {fmt_bytes(t.bytes) if t else '-':>10}  "
                     f"{e.name.rpartition('.')[2] if e else '-'} / {t.name.rpartition('.')[2] if t else '-'}")
    same = sum(r.equal for r in c.tensors)
    lines.append(f"  ({same} of {len(c.tensors)} keys hold the same dtype and bytes on both sides)")
    return lines


def render_comparison(c, *, detail: bool = False) -> str:
    """Activations per module, estimate vs trace, and the peak (a ``trainmem.compare.Comparison``)."""
    lines = ["Activations saved for backward, per module (estimate vs trace, CPU kernels)",
             f"  {'module':<48} {'estimate':>12} {'trace':>12} {'ratio':>7}"]
    exact = [r for r in c.rows if r.estimate_bytes == r.trace_bytes]
    for r in c.rows:
        if r in exact and not detail:
            continue
        ratio = f"{r.ratio:.3f}" if r.ratio is not None else f"only {'estimate' if r.lacks == 'trace' else 'trace'}"
        lines.append(f"  {r.name:<48} {fmt_bytes(r.estimate_bytes):>12} {fmt_bytes(r.trace_bytes):>12} {ratio:>7}")
    if exact and not detail:
        lines.append(f"  ({len(exact)} modules agree to the byte; --detail lists them)")
    ea, ta = c.activation_estimate_bytes, c.activation_trace_bytes
    lines.append(f"  {'total':<48} {fmt_bytes(ea):>12} {fmt_bytes(ta):>12} {ea / ta if ta else float('nan'):>7.3f}")
    lines.append("")
    ep, tp = c.estimate_peak_bytes, c.trace_peak_bytes
    lines.append(f"Peak allocated (logical bytes, no allocator rounding): estimate {fmt_bytes(ep)} "
                 f"({c.estimate_peak_phase}) vs trace {fmt_bytes(tp)} "
                 f"({c.trace_peak_phase}), ratio {ep / tp:.3f}")
    return "\n".join(lines)
