"""Reconcile an estimate with a trace: join by module path, ratio per module, peak side by side.

Estimate items are named ``<module path>.<label>`` and trace items ``<module path>.<aten op>``;
both sides are summed per module so the join does not depend on how a module's tensors are
labelled. The estimator's ``loss.*`` items live in the root module, where the loss is computed.
Activations also join tensor by tensor on their keys (``trainmem.join``): ``tensors``.
The trace runs CPU kernels, so the estimate it is compared with models ``device='cpu'``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from trainmem.inventory import Category, Inventory
from trainmem.join import JoinRow, join_items, module_of

__all__ = ["Comparison", "CompareRow", "compare", "SCHEMA"]

SCHEMA = "trainmem.compare/2"


@dataclass(frozen=True)
class CompareRow:
    name: str
    estimate_bytes: int
    trace_bytes: int

    @property
    def ratio(self) -> float | None:
        return self.estimate_bytes / self.trace_bytes if self.trace_bytes else None

    @property
    def lacks(self) -> str:
        if not self.trace_bytes:
            return "trace"
        if not self.estimate_bytes:
            return "estimate"
        return ""

    def to_dict(self) -> dict:
        return {"name": self.name, "estimate_bytes": self.estimate_bytes, "trace_bytes": self.trace_bytes,
                "ratio": self.ratio, "missing_in": self.lacks or None}


@dataclass(frozen=True)
class Comparison:
    rows: tuple[CompareRow, ...]
    estimate_peak_bytes: int
    estimate_peak_phase: str
    trace_peak_bytes: int
    trace_peak_phase: str
    model: Any = None  # the estimate's specs, echoed in the header's inputs
    step: Any = None
    impl: Any = None
    tensors: tuple[JoinRow, ...] = ()  # activations joined per tensor by key


    def _repr_html_(self) -> str:  # Jupyter
        from trainmem.report.notebook import result_html
        return result_html(self)
    @property
    def activation_estimate_bytes(self) -> int:
        return sum(r.estimate_bytes for r in self.rows)

    @property
    def activation_trace_bytes(self) -> int:
        return sum(r.trace_bytes for r in self.rows)

    def to_dict(self) -> dict:
        def side(e: int, t: int) -> dict:
            return {"estimate_bytes": e, "trace_bytes": t, "ratio": e / t if t else None}

        from trainmem.schemas import header
        return {
            **header("compare", model=self.model, step=self.step, impl=self.impl),
            "rows": [r.to_dict() for r in self.rows],
            "tensors": [r.to_dict() for r in self.tensors],
            "activations": side(self.activation_estimate_bytes, self.activation_trace_bytes),
            "peak": {**side(self.estimate_peak_bytes, self.trace_peak_bytes),
                     "estimate_phase": self.estimate_peak_phase, "trace_phase": self.trace_peak_phase},
        }


_module = module_of  # the name up to its last dot; the loss is the root's (trainmem.join)


def _per_module(inv: Inventory, *, estimate: bool) -> dict[str, int]:
    out: dict[str, int] = {}
    for item in inv:
        if item.category is Category.ACTIVATION:
            key = _module(item.name, estimate=estimate)
            out[key] = out.get(key, 0) + item.bytes
    return out


def compare(estimate, trace) -> Comparison:
    """Join an :class:`~trainmem.estimate.Estimate` and a ``TraceResult`` (activations per module,
    and the peak: the trace's logical peak, i.e. without allocator rounding)."""
    e = _per_module(estimate.inventory, estimate=True)
    t = _per_module(Inventory.of(trace.items), estimate=False)
    # inputs created outside the model are saved (ids by the embedding) but not traced as ops
    e.pop("(inputs)", None)
    names = list(e) + [n for n in t if n not in e]
    rows = tuple(CompareRow(n, e.get(n, 0), t.get(n, 0)) for n in names)
    return Comparison(rows, estimate.peak_bytes, estimate.peak_phase,
                      trace.peak_logical_bytes, trace.peak_phase,
                      model=estimate.model, step=estimate.step, impl=estimate.impl,
                      tensors=tuple(join_items(estimate.inventory, trace.items)))
