"""Terminal views of an estimate: a tree ledger → block → tensor with the formula beside each
term, and a compact one-screen summary.

Identical consecutive blocks are folded into one line (``blocks 0–31  32 × 416.03 MiB``) unless
``detail`` is asked for; then every block and every tensor gets its line.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from trainmem.inventory import LEDGERS, Category, MemoryItem
from trainmem.names import layer_of, split_block
from trainmem.report.units import fmt_bytes

if TYPE_CHECKING:  # renderers take results; they never import the estimator
    from trainmem.estimate import Estimate

__all__ = ["render_tree", "render_summary", "ledger_groups"]

TOP_TENSORS = 8  # tensors shown per group unless detail
BAR = 24  # characters of the widest bar in the summary


@dataclass(frozen=True)
class Group:
    """Blocks ``first..last`` (equal contents) of one ledger, or the tensors outside blocks."""

    label: str
    count: int  # how many blocks share these tensors (1 outside blocks)
    items: tuple[MemoryItem, ...]  # one block's tensors, names relative to the block

    @property
    def bytes_each(self) -> int:
        return sum(i.bytes for i in self.items)


def _relative(item: MemoryItem) -> MemoryItem:
    block = split_block(item.name)
    if not block:
        return item
    return MemoryItem.make(block[2], item.category, item.shape, item.dtype, item.bytes, item.formula)


def ledger_groups(items: list[MemoryItem], *, fold: bool = True) -> list[Group]:
    """Block groups and the outside-blocks group of one ledger's items, in block order."""
    blocks: dict[int, list[MemoryItem]] = {}
    outside: list[MemoryItem] = []
    for it in items:
        li = layer_of(it.name)
        (blocks.setdefault(li, []) if li is not None else outside).append(it)
    by_sig: dict[object, list[int]] = {}
    for li in sorted(blocks):
        key = tuple((_relative(i).name, i.bytes) for i in blocks[li]) if fold else li
        by_sig.setdefault(key, []).append(li)
    groups = [Group(_label(ids), len(ids), tuple(_relative(i) for i in blocks[ids[0]])) for ids in by_sig.values()]
    if outside:
        groups.append(Group("outside blocks", 1, tuple(outside)))
    return groups


def _label(ids: list[int]) -> str:
    """``block 3``, ``blocks 0–31``, ``blocks 1–2, 5–6, 9–10, … 29–30``."""
    runs: list[list[int]] = []
    for i in ids:
        if runs and runs[-1][-1] == i - 1:
            runs[-1].append(i)
        else:
            runs.append([i])
    parts = [f"{r[0]}" if len(r) == 1 else f"{r[0]}–{r[-1]}" for r in runs]
    if len(parts) > 4:
        parts = parts[:3] + [f"… {parts[-1]}"]
    return ("block " if len(ids) == 1 else "blocks ") + ", ".join(parts)


def _categories(e: Estimate) -> list[Category]:
    present = {i.category for i in e.inventory}
    if getattr(e, "serving", None) is not None:  # inference: weights and KV cache, no training ledgers
        return [c for c in Category if c in present]
    return list(LEDGERS) + [c for c in Category if c in present and c not in LEDGERS]


def render_tree(e: Estimate, depth: int = 3, *, detail: bool = False, top: int = TOP_TENSORS) -> str:
    """Ledger (depth 1) → block groups (2) → tensors (3), sizes in binary units, formulas beside.

    Without ``detail``: identical blocks are folded and each group shows its ``top`` largest
    tensors; with it, every block and tensor."""
    if depth < 1:
        raise ValueError(f"depth={depth}: must be 1 (ledgers), 2 (+ blocks) or 3 (+ tensors)")
    lines = [_headline(e)]
    for cat in _categories(e):
        items = [i for i in e.inventory if i.category is cat]
        total = sum(i.bytes for i in items)
        lines.append(f"{cat.value:<44} {fmt_bytes(total):>12}   Σ {len(items)} tensors")
        if depth < 2 or not items:
            continue
        groups = ledger_groups(items, fold=not detail)
        for gi, g in enumerate(groups):
            last_g = gi == len(groups) - 1
            branch, stem = ("└─ ", "   ") if last_g else ("├─ ", "│  ")
            size = fmt_bytes(g.bytes_each * g.count)
            how = f"{g.count} × {fmt_bytes(g.bytes_each)}" if g.count > 1 else f"{len(g.items)} tensors"
            lines.append(f"{branch}{g.label:<41} {size:>12}   {how}")
            if depth < 3:
                continue
            shown = sorted(g.items, key=lambda i: -i.bytes)
            rest = [] if detail else shown[top:]
            shown = shown if detail else shown[:top]
            for ti, it in enumerate(shown):
                end = ti == len(shown) - 1 and not rest
                lines.append(f"{stem}{'└─ ' if end else '├─ '}{_tensor(it)}")
            if rest:
                more = f"… {len(rest)} more"
                lines.append(f"{stem}└─ {more:<38} {fmt_bytes(sum(i.bytes for i in rest)):>12}")
    lines.append(f"{'sum of ledgers (not the peak)':<44} {fmt_bytes(sum(e.totals_bytes.values())):>12}")
    lines.append(f"peak {fmt_bytes(e.peak_bytes)} allocated in phase '{e.peak_phase}'")
    return "\n".join(lines)


def _tensor(it: MemoryItem) -> str:
    shape = "×".join(map(str, it.shape)) or "scalar"
    name = it.name if len(it.name) <= 38 else "…" + it.name[-37:]
    return f"{name:<38} {fmt_bytes(it.bytes):>12}   {it.formula or '':<14} [{shape}] {it.dtype}"


def head_note(m) -> str:
    """A classification head, when the model has one (docs/heads.md)."""
    return f", head={m.head} ({m.num_labels} labels)" if m.head in ("seq-cls", "token-cls") else ""


def _headline(e: Estimate) -> str:
    m, s, im = e.model, e.step, e.impl
    if getattr(e, "serving", None) is not None:
        from trainmem.report.inference_text import serving_settings
        return f"{m.name}: L={m.num_layers} H={m.hidden_size} · {serving_settings(e)}"
    return (f"{m.name}: L={m.num_layers} H={m.hidden_size}{head_note(m)} · B={s.batch} S={s.seq} {s.precision} "
            f"{s.optimizer}"
            f" · attention={im.attention} recompute={im.recompute} profile={im.profile}{im.float8_words()}")


def render_summary(e: Estimate) -> str:
    """One screen: the ledgers and phases as bars, the peak, and the largest tensors of a block."""
    totals = {c.value: e.totals_bytes.get(c.value, 0) for c in _categories(e)}
    widest = max([*totals.values(), *(p.bytes for p in e.phases), 1])
    lines = [_headline(e), "", "ledgers"]
    for name, b in totals.items():
        lines.append(f"  {name:<16} {fmt_bytes(b):>12}  {_bar(b, widest)}")
    lines += ["", "phases (live bytes)"]
    for p in e.phases:
        mark = "  ← peak" if p.name == e.peak_phase else ""
        lines.append(f"  {p.name:<16} {fmt_bytes(p.bytes):>12}  {_bar(p.bytes, widest)}{mark}")
    acts = [i for i in e.inventory if i.category is Category.ACTIVATION]
    groups = [g for g in ledger_groups(acts) if g.label != "outside blocks"]
    if groups:
        g = max(groups, key=lambda g: g.bytes_each)
        lines += ["", f"largest saved tensors of {g.label.split('–')[0].replace('blocks', 'block')} "
                      f"({fmt_bytes(g.bytes_each)} per block)"]
        for it in sorted(g.items, key=lambda i: -i.bytes)[:5]:
            lines.append(f"  {_tensor(it)}")
    from trainmem.report.wrap import wrap_line
    lines += ["", wrap_line(f"peak {fmt_bytes(e.peak_bytes)} allocated in phase '{e.peak_phase}' — {e.peak.note}")]
    return "\n".join(lines)


def _bar(n: int, widest: int) -> str:
    eighths = round(8 * BAR * n / widest) if widest else 0
    full, part = divmod(eighths, 8)
    return "█" * full + ("" if not part else " ▏▎▍▌▋▊▉"[part])
