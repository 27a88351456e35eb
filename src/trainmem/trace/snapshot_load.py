"""Read a CUDA memory snapshot pickle safely, and summarize it.

A snapshot (``torch.cuda.memory._snapshot()``, or :func:`trainmem.trace.snapshot.write_snapshot`)
is a pickle of plain data: dicts, lists, tuples, strings, numbers, booleans and None. Pickle itself
can call any importable function while loading, so :func:`load_snapshot` uses an unpickler that
admits no global at all: those plain types need none, and anything else (``os.system``, a class)
is refused with :class:`~trainmem.errors.ConfigError` before it is looked up.

Known limitations:
  - ``peak_bytes`` replays ``device_traces``; torch keeps only the last
    ``max_entries`` events, so for a truncated history it is the peak of what was kept.
  - Only the first device's trace is replayed when there are several.
"""

from __future__ import annotations

import io
import pickle
from dataclasses import dataclass, field
from pathlib import Path

from trainmem.errors import ConfigError

__all__ = ["load_snapshot", "summarize_snapshot", "SnapshotSummary"]

MAX_SNAPSHOT_BYTES = 4 << 30  # a 4 GiB pickle is not a snapshot anyone can read back


class _PlainDataUnpickler(pickle.Unpickler):
    """Builds containers and scalars only; every global (function, class) is refused."""

    def find_class(self, module: str, name: str):
        raise ConfigError(f"refused to load {module}.{name}: a memory snapshot holds plain data only")


def loads_snapshot(data: bytes, where: str = "snapshot") -> dict:
    """The snapshot dict in ``data``, or ConfigError."""
    try:
        obj = _PlainDataUnpickler(io.BytesIO(data)).load()
    except ConfigError as exc:
        raise ConfigError(f"{where}: {exc}") from None
    except RecursionError:
        raise ConfigError(f"{where}: pickle nested too deeply") from None
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, KeyError, IndexError,
            AttributeError, OverflowError, MemoryError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{where}: not a readable pickle ({type(exc).__name__}: {str(exc)[:120]})") from None
    if not isinstance(obj, dict) or not isinstance(obj.get("segments"), list):
        raise ConfigError(f"{where}: not a memory snapshot (expected a dict with a 'segments' list, "
                          f"got {type(obj).__name__})")
    traces = obj.get("device_traces", [])
    if not isinstance(traces, list) or not all(isinstance(t, list) for t in traces):
        raise ConfigError(f"{where}: 'device_traces' must be a list of lists")
    return obj


def load_snapshot(path: str | Path) -> dict:
    """Read a ``torch.cuda.memory._snapshot()`` pickle without running any code from it."""
    p = Path(path).expanduser()
    try:
        size = p.stat().st_size
        if not p.is_file():
            raise ConfigError(f"{path}: not a regular file")
        if size > MAX_SNAPSHOT_BYTES:
            raise ConfigError(f"{path}: {size} bytes is larger than {MAX_SNAPSHOT_BYTES >> 30} GiB, not read")
        data = p.read_bytes()
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read snapshot ({exc.strerror or exc})") from None
    return loads_snapshot(data, str(path))


@dataclass(frozen=True)
class Allocation:
    size_bytes: int
    where: str
    """The first frame: ``file:line name`` (trainmem's exports name module, op, phase and category)."""


@dataclass(frozen=True)
class SnapshotSummary:
    num_segments: int
    reserved_bytes: int
    """Sum of segment sizes at the time of the snapshot."""
    allocated_bytes: int
    """Active allocated blocks at the time of the snapshot."""
    peak_bytes: int
    """Largest live total while replaying the first device trace (0 without a trace)."""
    num_events: int
    top_allocations: tuple[Allocation, ...] = field(default_factory=tuple)
    """Largest allocations seen in the trace (or live blocks, without a trace), largest first."""

    def to_dict(self) -> dict:
        from trainmem.schemas import header
        # /2: reserved_bytes and allocated_bytes when the snapshot was taken; peak_bytes the allocated peak
        return {**header("snapshot"), "num_segments": self.num_segments, "reserved_bytes": self.reserved_bytes,
                "allocated_bytes": self.allocated_bytes, "peak_bytes": self.peak_bytes,
                "num_events": self.num_events,
                "top_allocations": [{"size_bytes": a.size_bytes, "where": a.where} for a in self.top_allocations]}


def _int(value, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ConfigError(f"snapshot: {what}={value!r:.40} is not a byte count")
    return value


def _where(frames) -> str:
    if isinstance(frames, list) and frames and isinstance(frames[0], dict):
        f = frames[0]
        return f"{f.get('filename', '?')}:{f.get('line', 0)} {f.get('name', '')}".strip()
    return "?"


def summarize_snapshot(snapshot: dict, *, top: int = 10) -> SnapshotSummary:
    """Segments, reserved and allocated bytes, the replayed peak and the largest allocations."""
    segments = snapshot.get("segments", [])
    reserved = allocated = 0
    live_blocks: list[Allocation] = []
    for seg in segments:
        if not isinstance(seg, dict):
            raise ConfigError("snapshot: a segment is not a dict")
        reserved += _int(seg.get("total_size", 0), "total_size")
        for b in seg.get("blocks", []) or []:
            if isinstance(b, dict) and b.get("state") == "active_allocated":
                size = _int(b.get("size", 0), "block size")
                allocated += size
                live_blocks.append(Allocation(size, _where(b.get("frames"))))
    traces = snapshot.get("device_traces") or [[]]
    events = traces[0] if traces else []
    live = peak = 0
    sizes: dict[int, int] = {}
    allocs: list[Allocation] = []
    for e in events:
        if not isinstance(e, dict):
            continue
        action = e.get("action")
        if action == "alloc":
            size = _int(e.get("size", 0), "alloc size")
            live += size
            sizes[e.get("addr")] = sizes.get(e.get("addr"), 0) + size
            peak = max(peak, live)
            allocs.append(Allocation(size, _where(e.get("frames"))))
        elif action == "free_completed":
            live -= sizes.pop(e.get("addr"), 0)
    pool = allocs or live_blocks
    pool.sort(key=lambda a: -a.size_bytes)
    return SnapshotSummary(num_segments=len(segments), reserved_bytes=reserved, allocated_bytes=allocated,
                           peak_bytes=peak, num_events=len(events), top_allocations=tuple(pool[:top]))
