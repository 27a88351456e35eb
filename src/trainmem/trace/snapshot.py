"""Export a trace as a CUDA memory snapshot (``torch.cuda.memory._snapshot()`` format).

The recorded allocs and frees are replayed through the caching allocator model to get
addresses and segments; the result opens in https://pytorch.org/memory_viz and in
``torch.cuda._memory_viz``. Each entry's frames name the module, op, phase and category
instead of Python source lines.

Known limitations:
  - The ``segments`` list is the state at the end of the traced step (what a snapshot taken
    after ``optimizer.zero_grad()`` would show); the timeline is in ``device_traces``.
  - ``time_us`` is the event index, not wall time.
"""

from __future__ import annotations

import pickle
from pathlib import Path

from trainmem.trace.allocator import CachingAllocator
from trainmem.trace.result import TraceResult, categorize, item_names

__all__ = ["to_memory_snapshot", "write_snapshot"]


def _frames(block, name: str, category: str) -> list[dict]:
    return [
        {"filename": name, "line": 0, "name": block.op or block.origin},
        {"filename": f"phase={block.phase}", "line": 0, "name": f"category={category}"},
    ]


def to_memory_snapshot(result: TraceResult, *, expandable_segments: bool = False) -> dict:
    """The snapshot dict: ``segments``, ``device_traces`` (one device) and allocator settings."""
    rec = result.recording
    if rec is None:
        raise ValueError("this TraceResult carries no recording (it was loaded, not traced)")
    cats, names = categorize(rec), item_names(rec)
    alloc = CachingAllocator(expandable_segments=expandable_segments)
    trace: list[dict] = []
    addr_of: dict[int, int] = {}
    seen_segments = 0
    for t, e in enumerate(rec.events):
        if e >= 0:
            blk = rec.blocks[e]
            reserved = alloc.reserved_bytes
            addr, _ = alloc.malloc(e, blk.nbytes)
            addr_of[e] = addr
            if alloc.reserved_bytes > reserved:
                segs = alloc.segments()
                for seg in segs[seen_segments:] if not expandable_segments else []:
                    trace.append({"action": "segment_alloc", "addr": seg["address"], "size": seg["total_size"],
                                  "stream": 0, "time_us": t, "frames": []})
                if expandable_segments:
                    trace.append({"action": "segment_map", "addr": addr, "size": alloc.reserved_bytes - reserved,
                                  "stream": 0, "time_us": t, "frames": []})
                seen_segments = len(segs)
            trace.append({"action": "alloc", "addr": addr, "size": blk.size, "stream": 0, "time_us": t,
                          "frames": _frames(blk, names[e], cats[e].value)})
        else:
            blk = rec.blocks[~e]
            alloc.free(~e)
            for action in ("free_requested", "free_completed"):
                trace.append({"action": action, "addr": addr_of[~e], "size": blk.size, "stream": 0,
                              "time_us": t, "frames": _frames(blk, names[~e], cats[~e].value)})

    live = {addr_of[b.id]: b for b in rec.blocks if b.free_at is None and b.id in addr_of}
    segments = []
    for seg in alloc.segments():
        blocks = []
        for b in seg["blocks"]:
            owner = live.get(b["address"]) if b["allocated"] else None
            blocks.append({
                "address": b["address"], "size": b["size"], "requested_size": b["requested_size"],
                "state": "active_allocated" if b["allocated"] else "inactive",
                "frames": _frames(owner, names[owner.id], cats[owner.id].value) if owner is not None else [],
            })
        allocated = sum(b["size"] for b in blocks if b["state"] == "active_allocated")
        segments.append({
            "device": 0, "address": seg["address"], "total_size": seg["total_size"],
            "allocated_size": allocated, "active_size": allocated,
            "requested_size": sum(b["requested_size"] for b in blocks), "stream": 0,
            "segment_type": seg["segment_type"], "segment_pool_id": (0, 0),
            "is_expandable": expandable_segments, "frames": [], "blocks": blocks,
        })
    return {
        "segments": segments,
        "device_traces": [trace],
        "allocator_settings": {"expandable_segments": expandable_segments, "PYTORCH_CUDA_ALLOC_CONF": "",
                               "max_split_size": -1},
        "trainmem": {"schema": result.to_dict(timeline=False)["schema"], "peak_bytes": result.peak_bytes,
                     "peak_reserved_bytes": result.peak_reserved_bytes},
    }


def write_snapshot(result: TraceResult, path: str | Path, *, expandable_segments: bool = False) -> Path:
    """Pickle the snapshot to ``path`` (open it at https://pytorch.org/memory_viz)."""
    from trainmem.atomic import atomic_path

    path = Path(path)
    snapshot = to_memory_snapshot(result, expandable_segments=expandable_segments)
    with atomic_path(path) as tmp, open(tmp, "wb") as f:
        pickle.dump(snapshot, f)
    return path
