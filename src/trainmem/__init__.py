"""trainmem: how much accelerator memory a Transformer training step needs.

The public API, with nothing heavy imported (torch and transformers load on first use)::

    import trainmem
    e = trainmem.estimate(trainmem.load_model("llama-3-8b"), trainmem.StepSpec(seq=4096))
    with trainmem.trace(model, optimizer) as t:   # needs torch
        step()

* ``estimate`` and ``trace`` are the subpackages ``trainmem.estimate`` and ``trainmem.trace``,
  callable: ``trainmem.estimate(...)`` is ``trainmem.estimate.estimate(...)`` and
  ``trainmem.trace(...)`` is ``trainmem.trace.trace(...)``, while ``import trainmem.trace as t``
  and ``from trainmem.estimate import Estimate`` keep working.
* ``load_model``, the specs, the errors (one hierarchy, :mod:`trainmem.errors`);
* ``guard`` and ``largest_micro_batch`` from ``trainmem.integrations``.

Other subpackages (``trainmem.measure``, ``trainmem.plan``, ``trainmem.report``, ...) are
imported by name. A new lazily imported export is one line in ``_LAZY``.
"""

from __future__ import annotations

import importlib as _importlib
import types as _types

from trainmem.errors import (ConfigError, DistributedRunError, DoesNotFit, HTTPStatusError, OutOfMemory,
                             PlotDependencyError, RequestError, SpecError, TrainmemError, UnsupportedError)
from trainmem.specs import ImplSpec, ModelSpec, ParallelSpec, StepSpec
from trainmem.specs.finetune import FinetuneSpec

__all__ = ["estimate", "trace", "load_model",
           "ModelSpec", "StepSpec", "ImplSpec", "ParallelSpec", "FinetuneSpec",
           "TrainmemError", "SpecError", "ConfigError", "UnsupportedError", "OutOfMemory", "DistributedRunError",
           "PlotDependencyError", "DoesNotFit", "RequestError", "HTTPStatusError",
           "guard", "largest_micro_batch"]

#: name -> module it is imported from on first use
_LAZY = {"load_model": "trainmem.specs.loaders",
         "guard": "trainmem.integrations.loop", "largest_micro_batch": "trainmem.integrations.batch"}


class _CallableModule(_types.ModuleType):
    """A subpackage that is also its main function, the one named like it."""

    def __call__(self, *args, **kwargs):
        return getattr(self, self.__name__.rpartition(".")[2])(*args, **kwargs)


def _callable_subpackage(name: str) -> _types.ModuleType:
    # imported here, before anything else can import it: loading a submodule later would set
    # trainmem.<name> to the plain module
    mod = _importlib.import_module(f"trainmem.{name}")
    mod.__class__ = _CallableModule
    return mod


estimate = _callable_subpackage("estimate")  # the estimator: pure Python, what every command imports
trace = _callable_subpackage("trace")  # its package imports nothing heavy; torch loads on the first trace


def __getattr__(name: str):
    mod = _LAZY.get(name)
    if mod is None:
        raise AttributeError(f"module 'trainmem' has no attribute {name!r}")
    return getattr(_importlib.import_module(mod), name)


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
