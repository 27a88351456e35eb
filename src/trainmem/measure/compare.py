"""Estimate, trace and measurement of one run side by side, with errors per ledger and peak.

Errors are ``(predicted − measured) / measured`` in percent: positive means the prediction is
too high. What each column counts:
  - estimate: the estimator's ledgers (logical bytes) and its phase peak;
  - trace: the traced step's items (saved activations, model states) and its 512-byte rounded
    allocated peak; its reserved peak is the allocator model's;
  - measured: the profile's instrumented step (ledgers) and the peak of its timed steps.

Activations also join tensor by tensor (``tensors``): the estimate's items, the trace's and the
measured step's (``trainmem.measure.tensors``) carry the same keys, ``<module>:<bytes>B:<k>``
(``trainmem.join``), and :func:`trainmem.join.join_sides` pairs them.
"""

from __future__ import annotations

from dataclasses import dataclass

from trainmem.inventory import LEDGERS
from trainmem.join import KeyRow, join_sides

__all__ = ["CompareRow", "CompareTable", "compare_table", "compare_run", "error_pct"]


def error_pct(predicted: int | None, measured: int | None) -> float | None:
    if predicted is None or measured is None or measured == 0:
        return None
    return 100.0 * (predicted - measured) / measured


@dataclass(frozen=True)
class CompareRow:
    name: str
    estimate_bytes: int | None
    trace_bytes: int | None
    measured_bytes: int | None

    @property
    def estimate_error_pct(self) -> float | None:
        return error_pct(self.estimate_bytes, self.measured_bytes)

    @property
    def trace_error_pct(self) -> float | None:
        return error_pct(self.trace_bytes, self.measured_bytes)

    def to_dict(self) -> dict:
        r = (lambda v: None if v is None else round(v, 3))
        return {"name": self.name, "estimate_bytes": self.estimate_bytes, "trace_bytes": self.trace_bytes,
                "measured_bytes": self.measured_bytes, "estimate_error_pct": r(self.estimate_error_pct),
                "trace_error_pct": r(self.trace_error_pct)}


@dataclass(frozen=True)
class CompareTable:
    rows: tuple[CompareRow, ...]
    device: str = ""
    tensors: tuple[KeyRow, ...] = ()
    """Activations per tensor by key: sides ``estimate``, ``trace``, ``measured`` (those given)."""

    def row(self, name: str) -> CompareRow:
        return next(r for r in self.rows if r.name == name)

    def to_dict(self) -> dict:
        return {"device": self.device, "rows": [r.to_dict() for r in self.rows],
                "tensors": [r.to_dict() for r in self.tensors]}


def compare_table(estimate=None, trace=None, measured=None) -> CompareTable:
    """Rows per ledger, then ``peak_allocated`` and ``peak_reserved``. Any column may be None.

    ``estimate``: an :class:`~trainmem.estimate.Estimate`; ``trace``: a
    :class:`~trainmem.trace.TraceResult`; ``measured``: a
    :class:`~trainmem.measure.profile_result.ProfileResult` (rank 0) or ``RankProfile``.
    """
    if measured is not None and hasattr(measured, "ranks"):
        measured = measured.ranks[0]
    est_tot = estimate.totals_bytes if estimate is not None else {}
    tr_tot = trace.items.totals() if trace is not None else {}
    me_tot = measured.totals_bytes if measured is not None else {}
    rows = [CompareRow(c.value, est_tot.get(c.value) if estimate is not None else None,
                       tr_tot.get(c.value) if trace is not None else None,
                       me_tot.get(c.value) if measured is not None else None) for c in LEDGERS]
    rows.append(CompareRow("peak_allocated", estimate.peak_bytes if estimate is not None else None,
                           trace.peak_bytes if trace is not None else None,
                           measured.peak_bytes if measured is not None else None))
    rows.append(CompareRow("peak_reserved", None, trace.peak_reserved_bytes if trace is not None else None,
                           measured.peak_reserved_bytes if measured is not None else None))
    tensors = join_sides({"estimate": estimate.inventory if estimate is not None else None,
                          "trace": trace.items if trace is not None else None,
                          "measured": measured.items if measured is not None else None})
    return CompareTable(tuple(rows), measured.device if measured is not None else "", tuple(tensors))


def compare_run(source, step, impl, *, measured=None, device=None, seed: int = 0, trace: bool = True,
                **profile_kwargs) -> tuple[CompareTable, object]:
    """Estimate, trace (fake tensors) and profile one run; returns (table, profile result).

    The estimate models the kernels of the device the run used (``ImplSpec.device``).
    """
    from dataclasses import replace

    from trainmem.estimate import estimate as run_estimate
    from trainmem.measure.profiling import profile_model
    from trainmem.specs import ModelSpec
    from trainmem.specs.loaders import spec_from_hf_config

    if measured is None:
        measured = profile_model(source, step, impl, device=device, seed=seed, **profile_kwargs)
    kind = "cuda" if measured.device.startswith("cuda") else "cpu"
    impl_dev = replace(impl, device=kind)
    spec = source if isinstance(source, ModelSpec) else spec_from_hf_config(source)
    if isinstance(source, ModelSpec) and impl_dev.profile != "reference":
        impl_dev = replace(impl_dev, profile="reference")
    est = run_estimate(spec, step, impl_dev)
    tr = None
    if trace:
        from trainmem.trace import trace_step
        tr = trace_step(source, step, impl_dev)
    return compare_table(est, tr, measured), measured
