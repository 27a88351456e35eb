"""MoE routing under an explicit assumption, so that expert-token counts are concrete on fake tensors.

A router's choice depends on data, which fake tensors do not hold. The trace replaces each
experts module's ``top_k_index`` (the router's top-k expert ids, shape ``(tokens, k)``) with a
fixed assignment built from ``ImplSpec.routing`` (see :func:`trainmem.specs.impl.routing_hot_fraction`):

  - the first ``ceil(F * tokens)`` tokens (F = 0 for ``balanced``, 1 for ``worst``, F for
    ``skewed:F``) choose the same experts ``0 .. k-1``;
  - token ``t`` of the rest, slot ``j`` chooses expert ``(t' * k + j) mod E`` (``t'`` counting
    from the first such token): every expert gets ``floor`` or ``ceil`` of its top-k share, and
    a token's k choices are distinct while ``k <= E``.

The router itself still runs (its logits, softmax and top-k weights are allocated as in
training); only its expert ids are replaced. Under ``torch.compile`` the same ids are computed from each
block's own router ids (:func:`_derived_index`), so that no two blocks share them as one graph value. The hook is a forward pre-hook on every module that
transformers' ``use_experts_implementation`` decorator built (``transformers/integrations/moe.py``:
``forward(hidden_states, top_k_index, top_k_weights)``), so it covers every family that routes
through that interface.

On fake tensors the per-expert loop (``experts_implementation="eager"``) still asks for data:
``nonzero`` and ``where`` on the expert mask, ``item`` on an expert id. :class:`ConcreteInts`
keeps a real copy of every tensor computed only from the fixed assignment and from integer
factories (``arange``), and answers those ops from it, so the loop runs with the counts the
assignment implies. Float activations stay fake.

Known limitations:
  - Capacity factors (token dropping) are not modelled: none of the families transformers 5.x
    routes through ``use_experts_implementation`` has one.
  - Families with their own expert code (Llama 4 runs every expert on every token) keep their
    own routing, whose memory does not depend on it.
"""

from __future__ import annotations

import contextlib
import math

__all__ = ["tokens_per_expert", "force_routing", "ConcreteInts", "experts_modules"]


def tokens_per_expert(num_tokens: int, num_experts: int, top_k: int, hot_fraction: float) -> tuple[int, ...]:
    """How many (token, slot) choices each expert receives under the fixed assignment."""
    hot = math.ceil(hot_fraction * num_tokens)
    counts = [0] * num_experts
    for j in range(top_k):
        counts[j % num_experts] += hot
    rest = (num_tokens - hot) * top_k
    for e in range(num_experts):
        counts[e] += rest // num_experts + (1 if e < rest % num_experts else 0)
    return tuple(counts)


def _forced_index(like, num_experts: int, hot_fraction: float):
    """The fixed ``(tokens, k)`` expert ids, built with torch ops so fake and real runs allocate alike."""
    import torch

    tokens, k = like.shape
    hot = math.ceil(hot_fraction * tokens)
    rest = (torch.arange((tokens - hot) * k, dtype=like.dtype, device=like.device) % num_experts).view(-1, k)
    if hot == 0:
        return rest
    same = torch.arange(k, dtype=like.dtype, device=like.device).remainder(num_experts).expand(hot, k)
    return torch.cat([same, rest])


def _derived_index(like, num_experts: int, hot_fraction: float):
    """The same ids as :func:`_forced_index`, computed from ``like`` (this block's router ids) for a compiled
    region. Built from constants, every block's ids would be one value of the graph: Dynamo and the joint
    graph's CSE (``torch/_functorch/compile_utils.py`` ``fx_graph_cse``) merge the blocks' identical
    ``arange`` chains, the partitioner then keeps one block's sort permutation and offsets for all of them, and
    under checkpointing saves them outside the checkpoints as a hoisted constant. ``like.clamp(max=0)`` is zero
    for ids (never negative) but not to the compiler, which does fold ``like * 0`` into a ``full`` (read in the
    partitioned graph), so each block's positions, hence its permutation, are its own tensor, as with a real
    router."""
    tokens, k = like.shape
    hot = math.ceil(hot_fraction * tokens) * k
    pos = (like.reshape(-1).clamp(max=0) + 1).cumsum(0) - 1  # arange(T·k): token t, slot j at t·k + j
    # the first hot tokens choose experts 0 .. k-1; the rest (t' counted from the first) (t'·k + j) mod E
    return (pos % k).where(pos < hot, pos - hot).remainder(num_experts).view(tokens, k)


def experts_modules(model) -> list:
    """The modules built by transformers' ``use_experts_implementation`` (they take ``top_k_index``)."""
    return [m for m in model.modules() if hasattr(m, "_is_expert_parallel") and hasattr(m, "num_experts")]


@contextlib.contextmanager
def force_routing(model, hot_fraction: float):
    """Replace every experts module's ``top_k_index`` with the fixed assignment while active."""
    import torch

    def hook(module, args, kwargs):
        # eager: integer factories, which ConcreteInts keeps concrete for the per-expert loop
        forced = _derived_index if torch.compiler.is_compiling() else _forced_index
        if "top_k_index" in kwargs:
            kwargs["top_k_index"] = forced(kwargs["top_k_index"], module.num_experts, hot_fraction)
        else:
            args = (args[0], forced(args[1], module.num_experts, hot_fraction), *args[2:])
        return args, kwargs

    handles = [m.register_forward_pre_hook(hook, with_kwargs=True) for m in experts_modules(model)]
    try:
        yield len(handles)
    finally:
        for h in handles:
            h.remove()


def _concrete_mode_class():
    import torch
    from torch._subclasses import fake_tensor as ft
    from torch.utils import _pytree as pytree
    from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
    from torch.utils.weak import WeakTensorKeyDictionary

    integral = (torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64)
    data_dependent = (ft.DynamicOutputShapeException, ft.DataDependentOutputException)

    class _ConcreteInts(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.real = WeakTensorKeyDictionary()

        def _to_real(self, x):
            return self.real[x] if isinstance(x, torch.Tensor) else x

        def _remember(self, fake_out, real_out) -> None:
            for f, r in zip(pytree.tree_leaves(fake_out), pytree.tree_leaves(real_out)):
                if isinstance(f, torch.Tensor) and isinstance(r, torch.Tensor):
                    self.real[f] = r

        def _run_real(self, func, args, kwargs):
            with _disable_current_modes():
                return func(*pytree.tree_map(self._to_real, args), **pytree.tree_map(self._to_real, kwargs))

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            tensors = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
            known = all(t in self.real for t in tensors)
            if not tensors:  # a factory: keep integer ones (arange, zeros of ids) concrete
                out = func(*args, **kwargs)
                if isinstance(out, torch.Tensor) and out.dtype in integral:
                    self._remember(out, self._run_real(func, args, kwargs))
                return out
            if not known:
                mutated = func._schema.is_mutable and tensors and tensors[0] in self.real
                out = func(*args, **kwargs)
                if mutated:  # written from data we do not hold
                    del self.real[tensors[0]]
                return out
            try:
                out = func(*args, **kwargs)
            except data_dependent:
                real_out = self._run_real(func, args, kwargs)
                if not isinstance(real_out, torch.Tensor) and not isinstance(real_out, (tuple, list)):
                    return real_out  # item(): the value itself
                out = pytree.tree_map(
                    lambda r: torch.empty_strided(r.shape, r.stride(), dtype=r.dtype, device=tensors[0].device)
                    if isinstance(r, torch.Tensor) else r, real_out)
                self._remember(out, real_out)
                return out
            self._remember(out, self._run_real(func, args, kwargs))
            return out

    return _ConcreteInts


def ConcreteInts():
    """A dispatch mode (enter it inside ``FakeTensorMode``) that keeps integer routing tensors real."""
    return _concrete_mode_class()()
