"""TraceResult: what a recording says, in the shared inventory schema.

Categories are decided from where a storage came from and how long it lived:
a storage an op made in forward that is still alive when the next backward starts is an
activation (saved for backward, or held by a checkpoint); one freed before is transient;
storages made in backward are transient (activation gradients, workspaces) except gradients
of parameters and tensors recomputed under activation checkpointing (activations).

bitsandbytes' paged optimizer states (``Recording.paged``, trace/low_bit_optim.py) sit in CUDA
unified memory, outside the caching allocator: they are items and a ledger
(``totals_at_peak_bytes["paged_optimizer_state"]``, logical bytes) of their own, never in the
allocated or reserved figures, so the other ledgers still sum to ``peak_bytes``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from trainmem.inventory import Category, Inventory, MemoryItem
from trainmem.join import activation_keys
from trainmem.report.units import downsample as _downsample
from trainmem.trace import recording as R
from trainmem.trace.allocator import replay

__all__ = ["TraceResult", "ModulePeak", "LiveTensor", "SCHEMA", "item_names"]

SCHEMA = "trainmem.trace/2"
TOP_AT_PEAK = 20
TIMELINE_POINTS = 2000  # the JSON timeline keeps each bucket's maximum

_ORIGIN_CATEGORY = {
    R.ORIGIN_PARAMETER: Category.PARAMETER,
    R.ORIGIN_BUFFER: Category.BUFFER,  # module buffers (rotary inv_freq): device memory, not parameters
    R.ORIGIN_GRADIENT: Category.GRADIENT,
    R.ORIGIN_MASTER: Category.MASTER_WEIGHT,
    R.ORIGIN_STATE: Category.OPTIMIZER_STATE,
    R.ORIGIN_INPUT: Category.INPUT,
    R.ORIGIN_RECOMPUTE: Category.ACTIVATION,
    R.ORIGIN_FSDP: Category.TRANSIENT,  # gathered for a unit's forward or backward, freed after it
}


@dataclass(frozen=True)
class ModulePeak:
    """Highest allocated bytes (whole process) while the module ran forward / backward."""

    name: str
    forward_peak_bytes: int
    backward_peak_bytes: int

    def to_dict(self) -> dict:
        return {"name": self.name, "forward_peak_bytes": self.forward_peak_bytes,
                "backward_peak_bytes": self.backward_peak_bytes}


@dataclass(frozen=True)
class LiveTensor:
    """One storage alive at the peak."""

    name: str
    category: Category
    bytes: int  # 512-byte rounded
    op: str
    phase: str
    shape: tuple[int, ...]
    dtype: str

    def to_dict(self) -> dict:
        return {"name": self.name, "category": self.category.value, "bytes": self.bytes, "op": self.op,
                "phase": self.phase, "shape": list(self.shape), "dtype": self.dtype}


@dataclass(frozen=True)
class TraceResult:
    """Everything one traced training step says about memory. Bytes are 512-byte rounded
    (what the CUDA allocator hands out for each request) unless the name says ``logical``."""

    peak_bytes: int
    peak_logical_bytes: int
    peak_phase: str
    peak_op: str
    peak_module: str
    peak_reserved_bytes: int
    peak_reserved_expandable_bytes: int
    fragmentation: float
    totals_at_peak_bytes: dict[str, int]
    modules: tuple[ModulePeak, ...]
    top_at_peak: tuple[LiveTensor, ...]
    alive_at_peak: tuple[LiveTensor, ...]
    items: Inventory
    timeline_allocated_bytes: tuple[int, ...]
    timeline_reserved_bytes: tuple[int, ...]
    phases: tuple[tuple[int, str], ...]  # (timeline index, phase) where each phase starts
    num_allocations: int
    meta: dict = field(default_factory=dict)
    recording: R.Recording | None = field(default=None, repr=False, compare=False)

    def _repr_html_(self) -> str:  # Jupyter
        from trainmem.report.notebook import trace_html
        return trace_html(self)

    def category_timeline(self, points: int = 1500) -> tuple[list[int], dict[str, list[int]]] | None:
        """Allocated bytes per category along the step (about ``points`` samples after the
        baseline), or None when the recording was not kept."""
        rec = self.recording
        if rec is None:
            return None
        cats = [c.value for c in categorize(rec)]
        names = list(dict.fromkeys(cats))
        live = dict.fromkeys(names, 0)
        base = rec.baseline
        step = max(1, (len(rec.events) - base) // points)
        xs: list[int] = []
        ys: dict[str, list[int]] = {n: [] for n in names}
        for i, e in enumerate(rec.events):
            b = rec.blocks[e if e >= 0 else ~e]
            live[cats[b.id]] += b.size if e >= 0 else -b.size
            if i >= base and (i - base) % step == 0:
                xs.append(i - base)
                for n in names:
                    ys[n].append(live[n])
        return xs, ys

    def to_dict(self, *, timeline: bool = True) -> dict:
        from trainmem.schemas import header
        m = self.meta
        # /2: what was asked is the header's inputs; meta keeps what the trace found (class, torch, ...)
        extra = {("model_class" if k == "model" else k): v for k, v in m.items()
                 if k not in ("step", "impl", "finetune", "model_name")}
        out = {
            **header("trace", model=m.get("model_name") or m.get("model"), step=m.get("step"), impl=m.get("impl"),
                     finetune=m.get("finetune")),
            "meta": extra,
            "peak_bytes": self.peak_bytes,
            "peak_logical_bytes": self.peak_logical_bytes,
            "peak_phase": self.peak_phase,
            "peak_op": self.peak_op,
            "peak_module": self.peak_module,
            "peak_reserved_bytes": self.peak_reserved_bytes,
            "peak_reserved_expandable_bytes": self.peak_reserved_expandable_bytes,
            "fragmentation": round(self.fragmentation, 6),
            "num_allocations": self.num_allocations,
            "totals_at_peak_bytes": dict(self.totals_at_peak_bytes),
            "modules": [m.to_dict() for m in self.modules],
            "top_at_peak": [t.to_dict() for t in self.top_at_peak],
            "items": [i.to_dict() for i in self.items],
        }
        if timeline:
            idx = _downsample(self.timeline_allocated_bytes, TIMELINE_POINTS)
            out["timeline"] = {
                "index": idx,
                "allocated_bytes": [self.timeline_allocated_bytes[i] for i in idx],
                "reserved_bytes": [self.timeline_reserved_bytes[i] for i in idx],
                "phases": [[i, p] for i, p in self.phases],
            }
        return out


def item_name(b: R.Block) -> str:
    """``<module path>.<op>`` for op outputs, the given name for model states and inputs."""
    if b.name:
        return b.name
    return f"{b.module}.{b.op}" if b.module else b.op


def item_names(rec: R.Recording) -> list[str]:
    """A unique name per block, by block id: :func:`item_name`, and ``:k`` after the k-th repeat
    (k = 1, 2, ... in allocation order), so ``model.layers.0.self_attn.cat`` and
    ``model.layers.0.self_attn.cat:1`` are the first and second outputs of ``cat`` in that module."""
    seen: dict[str, int] = {}
    out = []
    for b in rec.blocks:
        base = item_name(b)
        k = seen.get(base, 0)
        seen[base] = k + 1
        out.append(f"{base}:{k}" if k else base)
    return out


def categorize(rec: R.Recording) -> list[Category]:
    """Final category of every block (see the module docstring)."""
    bw_starts = [i for i, phase in rec.marks if phase == "backward"]
    cats = []
    for b in rec.blocks:
        cat = _ORIGIN_CATEGORY.get(b.origin)
        if cat is None:
            if b.phase == "forward":
                nxt = next((i for i in bw_starts if i > b.alloc_at), None)
                alive = nxt is not None and (b.free_at is None or b.free_at > nxt)
                cat = Category.ACTIVATION if alive else Category.TRANSIENT
            else:
                cat = Category.TRANSIENT
        cats.append(cat)
    return cats


def analyze(rec: R.Recording, meta: dict | None = None) -> TraceResult:
    """Turn a recording into a :class:`TraceResult`; the timeline starts after the baseline."""
    blocks, events = rec.blocks, rec.events
    cats = categorize(rec)
    total = logical = 0
    peak = peak_logical = 0
    peak_at = -1
    allocated: list[int] = []
    for i, e in enumerate(events):
        if e >= 0:
            b = blocks[e]
            total += b.size
            logical += b.nbytes
            if total > peak:
                peak, peak_at = total, i
            peak_logical = max(peak_logical, logical)
        else:
            b = blocks[~e]
            total -= b.size
            logical -= b.nbytes
        allocated.append(total)

    alive = [b for b in blocks[: blocks[events[peak_at]].id + 1]
             if b.alloc_at <= peak_at and (b.free_at is None or b.free_at > peak_at)] if peak_at >= 0 else []
    totals = {c.value: 0 for c in Category}
    live = []
    names = item_names(rec)
    for b in alive:
        cat = cats[b.id]
        totals[cat.value] += b.size
        live.append(LiveTensor(names[b.id], cat, b.size, b.op, b.phase, b.shape, b.dtype))
    totals[Category.PAGED_STATE.value] = sum(b.nbytes for b in rec.paged)
    top = sorted(live, key=lambda t: -t.bytes)[:TOP_AT_PEAK]
    peak_block = blocks[events[peak_at]] if peak_at >= 0 else None

    ev = [("alloc", e, blocks[e].nbytes, blocks[e].stream) if e >= 0 else ("free", ~e) for e in events]
    rep = replay(ev)
    rep_x = replay(ev, expandable_segments=True)

    modules = tuple(ModulePeak(m, rec.module_peaks.get((m, "forward"), 0), rec.module_peaks.get((m, "backward"), 0))
                    for m in rec.module_order)
    base = rec.baseline
    return TraceResult(
        peak_bytes=peak,
        peak_logical_bytes=peak_logical,
        peak_phase=peak_block.phase if peak_block else "",
        peak_op=peak_block.op if peak_block else "",
        peak_module=peak_block.module if peak_block else "",
        peak_reserved_bytes=rep.reserved_peak_bytes,
        peak_reserved_expandable_bytes=rep_x.reserved_peak_bytes,
        fragmentation=rep.fragmentation,
        totals_at_peak_bytes=totals,
        modules=modules,
        top_at_peak=tuple(top),
        alive_at_peak=tuple(live),
        items=_items(rec, cats, names),
        timeline_allocated_bytes=tuple(allocated[base:]) or (0,),
        timeline_reserved_bytes=tuple(rep.reserved_bytes[base:]) or (0,),
        phases=tuple((max(i - base, 0), p) for i, p in rec.marks),
        num_allocations=len(blocks) - base,
        meta=dict(meta or {}),
        recording=rec,
    )


def _items(rec: R.Recording, cats: list[Category], names: list[str]) -> Inventory:
    """Activations saved for backward (as alive when backward starts) and model states. An
    activation's key (``trainmem.join``) ranks it in allocation order among its module's of its size."""
    out = []
    kept = [b for b, cat in zip(rec.blocks, cats) if cat is Category.ACTIVATION and b.origin != R.ORIGIN_RECOMPUTE]
    keys = dict(zip((b.id for b in kept), activation_keys([item_name(b) for b in kept], [b.id for b in kept],
                                                          [b.nbytes for b in kept], estimate=False)))
    for b, cat in zip(rec.blocks, cats):
        if cat is Category.TRANSIENT or (cat is Category.ACTIVATION and b.origin == R.ORIGIN_RECOMPUTE):
            continue
        if cat is Category.ACTIVATION:
            note = "saved for backward" if b.saved else "alive at backward start (not seen by saved-tensor hooks)"
        else:
            note = "buffer" if b.origin == R.ORIGIN_BUFFER else ""
        out.append(MemoryItem(name=names[b.id], category=cat, shape=b.shape, dtype=b.dtype, bytes=b.nbytes,
                              formula=f"aten.{b.op}" if b.op else "", note=note, key=keys.get(b.id, "")))
    out += [MemoryItem(name=b.name or f"optimizer.paged.{b.id}", category=Category.PAGED_STATE, shape=b.shape,
                       dtype=b.dtype, bytes=b.nbytes, formula="bitsandbytes F.get_paged (cudaMallocManaged)",
                       note="CUDA unified memory, outside the caching allocator") for b in rec.paged]
    return Inventory.of(out)
