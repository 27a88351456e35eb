"""trainmem: how much accelerator memory a Transformer training step needs.

The subpackages are the API (``trainmem.estimate``, ``trainmem.trace``, ``trainmem.measure``,
``trainmem.plan``, ...). Exported here, lazily (nothing heavy is imported with ``trainmem``):
:func:`guard` and :func:`largest_micro_batch` from ``trainmem.integrations``.
"""

from __future__ import annotations

__all__ = ["guard", "largest_micro_batch"]

_WHERE = {"guard": "trainmem.integrations.loop", "largest_micro_batch": "trainmem.integrations.batch"}


def __getattr__(name: str):
    mod = _WHERE.get(name)
    if mod is None:
        raise AttributeError(f"module 'trainmem' has no attribute {name!r}")
    import importlib
    return getattr(importlib.import_module(mod), name)
