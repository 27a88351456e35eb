"""Measure real training steps and find the limits.

* :func:`profile` -- profile a user's step function; :func:`profile_model` -- build a reference
  or Hugging Face model and profile it (CUDA allocator statistics, or the CPU live set).
* :func:`sweep` -- largest sequence length or micro-batch within a budget, with growth laws.
* :func:`compare_table` / :func:`compare_run` -- estimate, trace and measurement side by side.
* :func:`parse_variants` / :func:`run_variants` -- settings side by side with numerics.

torch is imported only when these run.
"""

from __future__ import annotations

__all__ = ["profile", "profile_model", "profile_workload", "ProfileResult", "RankProfile", "OutOfMemory",
           "build_workload", "sweep", "SweepResult", "SweepPoint", "compare_table", "compare_run", "CompareTable",
           "parse_variants", "run_variants", "VariantsResult", "parse_size", "fit_growth", "GrowthFit"]

_WHERE = {
    "profile": "profiling", "profile_model": "profiling", "profile_workload": "profiling", "ProfileResult": "profile_result",
    "RankProfile": "profile_result", "OutOfMemory": "profiling", "build_workload": "workload",
    "sweep": "sweeps", "SweepResult": "sweeps", "SweepPoint": "sweeps",
    "compare_table": "compare", "compare_run": "compare", "CompareTable": "compare",
    "parse_variants": "variants", "run_variants": "variants", "VariantsResult": "variants",
    "parse_size": "units", "fit_growth": "fit", "GrowthFit": "fit",
}


def __getattr__(name: str):
    mod = _WHERE.get(name)
    if mod is None:
        raise AttributeError(f"module 'trainmem.measure' has no attribute {name!r}")
    import importlib
    return getattr(importlib.import_module(f"trainmem.measure.{mod}"), name)
