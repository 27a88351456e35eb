"""trainmem inside training loops: check before the first step, measure after it.

* :class:`~trainmem.integrations.hf.TrainMemCallback` -- for the Hugging Face ``Trainer``.
* :func:`~trainmem.integrations.loop.guard` -- for a plain PyTorch loop.
* :func:`~trainmem.integrations.batch.largest_micro_batch` -- the largest micro-batch that fits.
* :func:`~trainmem.integrations.hf.largest_batch_args` -- TrainingArguments with that micro-batch.

torch and transformers are imported only when these are used.
"""

from __future__ import annotations

__all__ = ["TrainMemCallback", "largest_batch_args", "guard", "largest_micro_batch", "BatchFit", "GuardReport",
           "Check", "Measured", "DoesNotFit"]

_WHERE = {"TrainMemCallback": "hf", "largest_batch_args": "hf", "guard": "loop",
          "largest_micro_batch": "batch", "BatchFit": "batch", "GuardReport": "check", "Check": "check",
          "Measured": "check", "DoesNotFit": "check"}


def __getattr__(name: str):
    mod = _WHERE.get(name)
    if mod is None:
        raise AttributeError(f"module 'trainmem.integrations' has no attribute {name!r}")
    import importlib
    return getattr(importlib.import_module(f"trainmem.integrations.{mod}"), name)
