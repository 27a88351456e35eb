"""Model states: parameters, gradients, master weights and optimizer states, per parameter.

Optimizer state layouts follow the PyTorch, transformers, bitsandbytes and torchao
implementations, one registered layout per optimizer (``estimate/state_items.py``).
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Callable

from trainmem.estimate.params import kept_fp32, parameter_shapes
from trainmem.estimate.state_items import optimizer_state_items as _states
from trainmem.estimate.state_items import shared_state_items, state_item as _item
from trainmem.inventory import Category, Inventory, MemoryItem, Repeat, dtype_bytes
from trainmem.names import split_block
from trainmem.estimate.optimizer_step import Stepped, recipe_transient
from trainmem.specs import ImplSpec, ModelSpec, StepSpec

__all__ = ["model_state_items", "optimizer_step_transient_bytes", "optimizer_transient"]


def model_state_items(model: ModelSpec, step: StepSpec, finetune=None, profile: str = "hf") -> list[MemoryItem]:
    """One item per parameter and ledger, named ``<parameter name>[.<state>]`` (the profile's
    parameter names: ``estimate/params.py`` ``parameter_shapes``).

    ``finetune`` (a FinetuneSpec): frozen parameters carry no gradient, master or optimizer
    items; LoRA adapters and QLoRA's 4-bit storage are added (``estimate/finetune.py``)."""
    if finetune is not None:
        from trainmem.estimate.finetune import finetune_state_items
        return finetune_state_items(model, step, finetune)
    items = _items_for(parameter_shapes(model, profile), step, kept_fp32(model, profile))
    return items + shared_state_items(step, items)


def model_state_inventory(model: ModelSpec, step: StepSpec, profile: str = "hf") -> Inventory:
    """:func:`model_state_items` with identical blocks stored once (block 0 as the template)."""
    shapes = _two_block_shapes(model, profile)
    prefix, blocks = _block_prefix(shapes)
    if prefix is None or blocks != 2:
        return Inventory(model_state_items(model, step, profile=profile))
    blocks = model.num_layers
    own = [(n, sh) for n, sh in shapes if not n.startswith(prefix)]
    first = [(n, sh) for n, sh in shapes if n.startswith(f"{prefix}0.")]
    fp32 = kept_fp32(model, profile)
    template = _items_for(first, step, fp32)
    base = _items_for(own, step, fp32)
    return Inventory(base + shared_state_items(step, base + template) + template,
                     (Repeat(tuple(template), prefix, 0, tuple(range(1, blocks)), shift_previous=False),))


def _two_block_shapes(model: ModelSpec, profile: str) -> list[tuple[str, tuple[int, ...]]]:
    """Parameter shapes of the same model cut to two blocks: everything outside the blocks and
    one block's worth, whatever the depth (blocks are alike; :func:`_block_prefix` checks)."""
    if model.num_layers <= 2 or not model.uniform:  # blocks of several kinds: every block's own
        return parameter_shapes(model, profile)
    return parameter_shapes(replace(model, num_layers=2, layer_kinds=model.layer_kinds[:2]), profile)


def _block_prefix(shapes: list[tuple[str, tuple[int, ...]]]) -> tuple[str | None, int]:
    """The blocks' name prefix and count, when every block has block 0's parameters."""
    per: dict[int, list] = {}
    prefix = None
    for name, shape in shapes:
        block = split_block(name)
        if block:
            prefix, index, inside = block
            per.setdefault(index, []).append((inside, shape))
    if prefix is None or len(per) < 2 or any(v != per[0] for v in per.values()):
        return None, 0
    return prefix, len(per)


def _items_for(shapes: list[tuple[str, tuple[int, ...]]], step: StepSpec,
               fp32: Callable[[str], bool] | None = None) -> list[MemoryItem]:
    """``fp32``: the parameters a 16-bit load keeps in fp32 (``params.kept_fp32``); their gradients
    are fp32 too (``AccumulateGrad`` makes ``.grad`` like the parameter) and so are optimizer states
    made ``zeros_like`` the parameter (torch ``AdamW._init_group``)."""
    out: list[MemoryItem] = []
    train = step.mode == "train"
    for name, shape in shapes:
        d = step.dtypes
        if fp32 is not None and dtype_bytes(d.param) < 4 and fp32(name):
            d = replace(d, param="float32", grad="float32",
                        state="float32" if d.state == d.param else d.state)
        pb, gb = dtype_bytes(d.param), dtype_bytes(d.grad)
        out.append(_item(name, Category.PARAMETER, shape, d.param, f"numel·{pb:g}"))
        if not train:
            continue
        out.append(_item(f"{name}.grad", Category.GRADIENT, shape, d.grad, f"numel·{gb:g}"))
        if d.master:
            out.append(_item(f"{name}.master", Category.MASTER_WEIGHT, shape, d.master, "numel·4"))
        out.extend(_states(name, shape, step, d.state))
    return out


def optimizer_transient(model: ModelSpec, step: StepSpec, states, finetune=None,
                        impl: ImplSpec | None = None) -> tuple[int, str]:
    """Temporaries of ``optimizer.step()`` over the parameters that train: every parameter, or,
    when fine-tuning, those with optimizer states among ``states`` (the whole model's state items).
    The single-device and the per-rank estimates both call this one rule."""
    if finetune is None:
        return optimizer_step_transient_bytes(model, step, impl)
    from trainmem.estimate.finetune import finetune_optimizer_transient
    return finetune_optimizer_transient(list(states), step, impl)


def optimizer_step_transient_bytes(model: ModelSpec, step: StepSpec, impl: ImplSpec | None = None) -> tuple[int, str]:
    """Temporaries alive during ``optimizer.step()`` and the rule they come from.

    Mixed precision first makes fp32 copies of the 16-bit gradients for the fp32 optimizer; the
    step's own temporaries depend on the optimizer and its implementation
    (``estimate/optimizer_step.py``: foreach AdamW holds ``sqrt(exp_avg_sq)`` of every parameter,
    the for-loop those of one tensor and its neighbour, fused nothing). With the optimizer in backward
    these are one parameter's (see :func:`stepped_of_model`).
    """
    stepped = stepped_of_model(model, step, (impl or ImplSpec()).profile)
    return recipe_transient(step, impl or ImplSpec(), stepped, stepped.total_bytes if step.dtypes.master else 0)


def stepped_of_model(model: ModelSpec, step: StepSpec, profile: str = "hf") -> Stepped:
    """Total and per-tensor bytes of the tensors the optimizer steps (states' dtype: fp32 masters
    under a master-weight recipe, else the parameters)."""
    two = _two_block_shapes(model, profile)
    prefix, blocks = _block_prefix(two)
    if prefix is None or model.num_layers <= 2:
        sizes = [math.prod(s) for _, s in parameter_shapes(model, profile)]
        total = sum(sizes)
    else:  # blocks are alike: outside + num_layers × one block; two blocks show every neighbour
        own = sum(math.prod(s) for n, s in two if not n.startswith(prefix))
        block = sum(math.prod(s) for n, s in two if n.startswith(f"{prefix}0."))
        total = own + model.num_layers * block
        sizes = [math.prod(s) for _, s in two]
    sb = dtype_bytes(step.dtypes.state)
    return Stepped(int(total * sb), tuple(int(n * sb) for n in sizes), sb)
