"""What a profile returns: one :class:`RankProfile` per process, gathered in a :class:`ProfileResult`
(``trainmem.profile/2``)."""

from __future__ import annotations

from dataclasses import dataclass, field

from trainmem.inventory import MemoryItem
from trainmem.trace.result import ModulePeak

__all__ = ["SCHEMA", "RankProfile", "ProfileResult"]

SCHEMA = "trainmem.profile/2"


@dataclass(frozen=True)
class RankProfile:
    """One process's measurement. Bytes are what the allocator reports (CUDA) or the bytes of
    live storages (CPU); ``None`` where the device has no such number."""

    rank: int
    device: str
    peak_bytes: int
    peak_reserved_bytes: int | None
    peak_active_bytes: int | None
    num_alloc_retries: int | None
    num_ooms: int | None
    baseline_bytes: int
    """Allocated when the instrumented step starts: parameters, buffers, optimizer state, inputs."""
    context_bytes: int | None
    """Device memory in use but not reserved by the caching allocator (CUDA context, library workspaces)."""
    tokens_per_s: float | None
    step_time_s: float
    totals_bytes: dict[str, int]
    modules: tuple[ModulePeak, ...] = ()
    categories_at_peak_bytes: dict[str, int] | None = None
    losses: tuple[float, ...] = ()
    first_grad_norm: float | None = None
    snapshot: str | None = None
    items: tuple[MemoryItem, ...] = ()
    """The first micro-batch's activations, one per storage, keyed as the estimate's (``trainmem.join``)."""

    def to_dict(self) -> dict:
        return {
            "rank": self.rank, "device": self.device,  # /2: peak_bytes is the allocated peak, as everywhere
            "peak_bytes": self.peak_bytes, "peak_reserved_bytes": self.peak_reserved_bytes,
            "peak_active_bytes": self.peak_active_bytes, "num_alloc_retries": self.num_alloc_retries,
            "num_ooms": self.num_ooms, "baseline_bytes": self.baseline_bytes, "context_bytes": self.context_bytes,
            "tokens_per_s": self.tokens_per_s, "step_time_s": self.step_time_s,
            "totals_bytes": dict(self.totals_bytes),
            "modules": [m.to_dict() for m in self.modules],
            "categories_at_peak_bytes": self.categories_at_peak_bytes,
            "losses": list(self.losses), "first_grad_norm": self.first_grad_norm, "snapshot": self.snapshot,
            "items": [i.to_dict() for i in self.items],
        }

    @classmethod
    def from_dict(cls, d: dict) -> "RankProfile":
        d = dict(d)
        d["modules"] = tuple(ModulePeak(**m) for m in d.get("modules", ()))
        d["losses"] = tuple(d.get("losses", ()))
        from trainmem.measure.tensors import item_from_dict
        d["items"] = tuple(item_from_dict(i) for i in d.get("items", ()))
        return cls(**d)


@dataclass(frozen=True)
class ProfileResult:
    """Every rank's :class:`RankProfile` (one when not distributed)."""

    ranks: tuple[RankProfile, ...]
    meta: dict = field(default_factory=dict)

    @property
    def device(self) -> str:
        return self.ranks[0].device

    @property
    def peak_bytes(self) -> int:
        return max(r.peak_bytes for r in self.ranks)

    @property
    def peak_reserved_bytes(self) -> int | None:
        vals = [r.peak_reserved_bytes for r in self.ranks if r.peak_reserved_bytes is not None]
        return max(vals) if vals else None

    @property
    def tokens_per_s(self) -> float | None:
        """Throughput of the whole job (sum over ranks)."""
        vals = [r.tokens_per_s for r in self.ranks]
        return None if any(v is None for v in vals) else sum(vals)

    @property
    def totals_bytes(self) -> dict[str, int]:
        return self.ranks[0].totals_bytes

    @property
    def items(self) -> tuple[MemoryItem, ...]:
        """Rank 0's activations, tensor by tensor (:attr:`RankProfile.items`)."""
        return self.ranks[0].items

    def to_dict(self) -> dict:
        from trainmem.schemas import header
        m = self.meta
        return {**header("profile", model=m.get("model_name") or m.get("model"), step=m.get("step"),
                         impl=m.get("impl")),
                "meta": {("model_class" if k == "model" else k): v for k, v in m.items()
                         if k not in ("step", "impl", "model_name")},
                "device": self.device,
                "peak_bytes": self.peak_bytes, "peak_reserved_bytes": self.peak_reserved_bytes,
                "tokens_per_s": self.tokens_per_s, "totals_bytes": dict(self.totals_bytes),
                "items": [i.to_dict() for i in self.items],
                "ranks": [r.to_dict() for r in self.ranks]}
