"""Which linears Float8 training converts: torchtitan's filter over torchao's ``nn.Linear`` swap.

A fact about the model and ``ImplSpec.float8``, below both the estimator (``estimate/float8.py``:
what a converted linear keeps) and the tracer (``trace/float8.py``: the filter it hands torchao).
"""

from __future__ import annotations

from trainmem.families import task_head_modules

__all__ = ["TASK_HEADS", "converted", "is_linear_module"]

TASK_HEADS = task_head_modules()
"""Task heads (sequence/token classification: every family's ``task_heads``), left in high
precision like the output layer."""


def is_linear_module(model, weight_path: str) -> bool:
    """Whether the Hugging Face module owning ``weight_path`` is an ``nn.Linear`` (torchao converts
    only those): not an embedding, not GPT-2's ``Conv1D`` (the family's ``conv1d``:
    transformers/pytorch_utils.py ``Conv1D``), not an MoE router (modeling_mixtral.py
    ``MixtralTopKRouter``: a Parameter read by ``F.linear``). ``model``: the ModelSpec, or None for a
    module torchao offers the filter (an ``nn.Linear`` already)."""
    if model is None:
        return True
    from trainmem.families import family_of
    from trainmem.names import is_embedding
    if is_embedding(weight_path) or family_of(model).conv1d:  # GPT-2's only nn.Linear is its head
        return False
    return not (model.num_experts and weight_path.endswith(".mlp.gate.weight"))


def converted(model, weight_path: str, weight: tuple[int, ...]) -> bool:
    """torchtitan's ``module_filter_fn`` with the head filtered: an ``nn.Linear`` whose
    ``(out, in)`` are both multiples of 16 and which is not an output or task head."""
    from trainmem.names import is_head, under
    if len(weight) != 2 or is_head(weight_path) or under(weight_path, task_head_modules()):
        return False
    if not is_linear_module(model, weight_path):
        return False
    return weight[0] % 16 == 0 and weight[1] % 16 == 0
