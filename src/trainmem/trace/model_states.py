"""The model states a recording starts with or gains: parameters, buffers, gradients, master weights
and optimizer states, each a named block of a :class:`~trainmem.trace.block_book.BlockBook`.

Names follow ``named_parameters()`` (``<param>.grad``, ``<param>.<state key>``); an optimizer's own
copies of parameters the model does not hold (master weights) are ``optimizer.<i>.master.<group>.<j>``.
"""

from __future__ import annotations

import torch

from trainmem.trace.block_book import BlockBook
from trainmem.trace.low_bit_optim import is_paged_state
from trainmem.trace.qlora import quantized_parts
from trainmem.trace.recording import (ORIGIN_BUFFER, ORIGIN_GRADIENT, ORIGIN_MASTER, ORIGIN_OP, ORIGIN_PARAMETER,
                                      ORIGIN_STATE)
from trainmem.trace.torchao_optim import state_parts

__all__ = ["register_states", "register_opt_state", "name_unit_grads", "add_grad_hooks"]


def _masters(i: int, opt, params: set[int]):
    """``(label, p)`` for each parameter optimizer ``i`` steps that the model does not hold."""
    for g, group in enumerate(opt.param_groups):
        for j, p in enumerate(group["params"]):
            if id(p) not in params:
                yield f"optimizer.{i}.master.{g}.{j}", p


def register_states(book: BlockBook, model: torch.nn.Module | None, optimizers) -> set[int]:
    """Every model state alive now; the ids of the model's parameters."""
    params: set[int] = set()
    if model is not None:
        for name, p in model.named_parameters(remove_duplicate=True):
            owner = name.rpartition(".")[0]
            for suffix, t in quantized_parts(p) or (("", p),):  # a 4-bit weight's storages (trace/qlora.py)
                book.register(t, ORIGIN_PARAMETER, owner, name=name + suffix)
            params.add(id(p))
            if p.grad is not None:
                book.register(p.grad, ORIGIN_GRADIENT, owner, name=name + ".grad")
        for name, b in model.named_buffers():
            book.register(b, ORIGIN_BUFFER, name.rpartition(".")[0], name=name)
    for i, opt in enumerate(optimizers):
        for label, p in _masters(i, opt, params):
            book.register(p, ORIGIN_MASTER, "optimizer", name=label)
            if p.grad is not None:
                book.register(p.grad, ORIGIN_GRADIENT, "optimizer", name=label + ".grad")
        register_opt_state(book, model, opt, i)
    return params


def register_opt_state(book: BlockBook, model: torch.nn.Module | None, opt, i: int) -> None:
    """Optimizer ``i``'s state tensors (made lazily by its first step), named after their parameters."""
    names = {}
    if model is not None:
        names = {id(p): n for n, p in model.named_parameters()}
    for j, (p, state) in enumerate(opt.state.items()):
        base = names.get(id(p), f"optimizer.{i}.param.{j}")
        for k, v in state.items():
            if isinstance(v, torch.Tensor) and k == "step" and v.dim() == 0:
                book.add_host_step(v)
            elif isinstance(v, torch.Tensor) and is_paged_state(v):
                book.register_paged(v, name=f"{base}.{k}")
            elif isinstance(v, torch.Tensor):
                for suffix, t in state_parts(v) or (("", v),):  # torchao's state subclasses: their tensors
                    blk = book.register(t, ORIGIN_STATE, "optimizer", name=f"{base}.{k}{suffix}")
                    if blk is not None and blk.origin == ORIGIN_OP:
                        blk.origin, blk.name = ORIGIN_STATE, f"{base}.{k}{suffix}"


def name_unit_grads(book: BlockBook, model: torch.nn.Module) -> None:
    """FSDP's sharded gradients are views of one reduce-scatter output per unit: claimed by the
    gradient hooks FSDP2 runs itself (``foreach_reduce``, _fsdp_collectives.py), assigned by FSDP1
    (``_reduce_grad``, _runtime_utils.py: the flat parameter's ``.grad``, the original parameters'
    views of it) without a hook. Each such storage is a gradient, named after the unit's module
    prefix (``model.layers.0.grads``) rather than one of its parameters."""
    by_key: dict[int, list[str]] = {}
    blocks = {}
    for name, p in model.named_parameters():
        entry = book.storages.get(p.grad) if p.grad is not None else None
        if entry is not None and entry.data.id >= 0 and entry.data.origin in (ORIGIN_GRADIENT, ORIGIN_OP):
            by_key.setdefault(entry.key, []).append(name)
            blocks[entry.key] = entry.data
    for key, names in by_key.items():
        blocks[key].origin = ORIGIN_GRADIENT
        blocks[key].name = blocks[key].name or names[0] + ".grad"
        if len(names) > 1:
            common = []
            for parts in zip(*(n.split(".") for n in names)):
                if len(set(parts)) > 1:
                    break
                common.append(parts[0])
            blocks[key].name = ".".join(common or ["root"]) + ".grads"


def add_grad_hooks(book: BlockBook, model: torch.nn.Module | None, optimizers, params: set[int], current) -> list:
    """Post-accumulate-grad hooks claiming each trainable parameter's gradient when it is accumulated, in
    the module ``current()`` names; their handles."""
    def hook_for(name: str):
        def hook(p) -> None:
            if p.grad is not None:
                book.claim(p.grad, ORIGIN_GRADIENT, current(), name + ".grad")
        return hook

    handles = []
    if model is not None:
        for name, p in model.named_parameters():
            if p.requires_grad:
                handles.append(p.register_post_accumulate_grad_hook(hook_for(name)))
    for i, opt in enumerate(optimizers):
        for label, p in _masters(i, opt, params):
            if p.requires_grad:
                handles.append(p.register_post_accumulate_grad_hook(hook_for(label)))
    return handles
