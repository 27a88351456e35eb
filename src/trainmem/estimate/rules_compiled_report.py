"""Both saved sets of a compiled step, as ``trace --compile`` reports them (issue 13, mechanism 1:
"report what eager and what compile save"): the compiled one is the estimate's own activations
ledger, the eager one the same estimate without ``--compile``. The keys are the trace's
(``meta.compile`` in ``trace --json``: ``trace/compiled.py``), so the two results join on them."""

from __future__ import annotations

from dataclasses import replace

__all__ = ["saved_sets"]


def saved_sets(result, model, step, impl, parallel=None, finetune=None) -> dict:
    """``{"scope", "saved_eager_bytes", "saved_compiled_bytes"}`` of a compiled ``result``
    (``estimate(model, step, impl, parallel, finetune=finetune)`` with ``impl.compile``)."""
    from trainmem.estimate import estimate  # the package imports the rules: import it when called
    if not impl.compile:
        raise ValueError("saved_sets: impl.compile is False; there is one saved set")
    eager = estimate(model, step, replace(impl, compile=False, compile_scope="model"), parallel, finetune=finetune)
    return {"scope": impl.compile_scope, "saved_eager_bytes": eager.totals_bytes.get("activation", 0),
            "saved_compiled_bytes": result.totals_bytes.get("activation", 0)}

