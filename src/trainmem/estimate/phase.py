"""One phase of a step's timeline: its name, its bytes, and what they are (``estimate/peak.py``
builds them; the other estimate modules that add a phase import it from here)."""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["Phase"]


@dataclass(frozen=True)
class Phase:
    name: str
    bytes: int
    parts: dict[str, int] = field(default_factory=dict)
    note: str = ""

    def to_dict(self) -> dict:
        from trainmem.schemas import part_key  # /2: ledger parts named as the categories (singular)
        return {"name": self.name, "bytes": self.bytes, "parts": {part_key(k): v for k, v in self.parts.items()},
                "note": self.note}
