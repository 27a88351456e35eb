"""Validated, frozen specifications: model, step, implementation."""

from trainmem.specs.impl import ImplSpec
from trainmem.specs.model import ModelSpec
from trainmem.specs.parallel import ParallelSpec
from trainmem.specs.step import StepSpec

__all__ = ["ModelSpec", "StepSpec", "ImplSpec", "ParallelSpec"]
