"""Ground truth for activations: what autograd really keeps for backward.

Two measurements, used by the tests that hold the estimator to account (single-process here,
per rank in ``trainmem.measure_dist``):

* :func:`saved_tensors` -- ``saved_tensors_hooks`` during a forward: the distinct local storages
  packed for backward and still held when forward returns (a DTensor is read through its local
  shard), parameters excluded (their
  storages, FSDP2's unsharded copies, and views of either), de-duplicated by storage identity,
  with shape, dtype and the ``grad_fn`` of the tensor that was saved.
* :func:`retained_bytes` -- live-storage tracking: bytes created during a forward that are
  still alive after it (what autograd and checkpoint regions retain). Hooks cannot see inside
  ``torch.utils.checkpoint`` regions; this can.

Known limitations: the hooks see tensors at pack time, so a storage resized later is counted
at its pack size; ``retained_bytes`` counts only storages created by ops inside the call.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from trainmem.trace.storages import is_parameter, local, parameter_storage_keys

__all__ = ["SavedTensor", "saved_tensors", "retained_bytes", "step_peak_bytes", "explain_difference"]


@dataclass(frozen=True)
class SavedTensor:
    shape: tuple[int, ...]
    dtype: str
    nbytes: int
    grad_fn: str | None
    dtensor: bool = False  # saved as a DTensor; shape and bytes are its local shard's


def saved_tensors(model, fn: Callable[[], Any], buffers: bool = True) -> tuple[list[SavedTensor], Any]:
    """Run ``fn()`` (a forward + loss) and list the distinct local storages autograd saved;
    ``buffers=False`` leaves out ``model``'s registered buffers autograd saves as they are (Gemma's
    ``embed_scale``): device memory of the buffer ledger, not activations."""
    import torch

    import weakref

    params = parameter_storage_keys(model)
    if not buffers:
        params |= {local(b).untyped_storage()._cdata for b in model.buffers()}
    # storage key -> (what was saved, weak references to every tensor packed on that storage).
    # A tensor packed by a graph branch that forward then drops (DeepSeek's group-limited router:
    # the group top-k and the masked_fill mask feed only integer indices) dies before forward ends,
    # and its storage's address (the key) can be reused by a later saved tensor: a key whose
    # tensors are all dead is a new storage, and only storages still held at the end count.
    seen: dict[int, tuple[SavedTensor, list]] = {}

    def alive(refs: list) -> bool:
        return any(r() is not None for r in refs)

    def pack(t):
        lt = local(t)
        st = lt.untyped_storage()
        key = st._cdata
        if key in seen and not alive(seen[key][1]):
            del seen[key]
        if key in seen:
            seen[key][1].append(weakref.ref(t))
        elif key not in params and not is_parameter(t) and not is_parameter(lt):
            seen[key] = (SavedTensor(tuple(lt.shape), str(lt.dtype).removeprefix("torch."), st.nbytes(),
                                     t.grad_fn.name() if t.grad_fn is not None else None, lt is not t),
                         [weakref.ref(t)])
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return [s for s, refs in seen.values() if alive(refs)], out


def retained_bytes(model, fn: Callable[[], Any]) -> tuple[int, Any]:
    """Bytes of storages created inside ``fn()`` that are still alive when it returns.

    Parameters and buffers of ``model`` (and views of them) are never counted. Storages are
    held only through weak references, so tracking does not extend lifetimes.
    """
    from trainmem.trace.live import LiveStorages
    from trainmem.trace.storages import storage_key

    existing = [storage_key(t) for t in (*model.parameters(), *model.buffers())]
    with LiveStorages(skip_keys=existing) as live:
        out = fn()
    return live.now, out


def step_peak_bytes(model, optimizer, step: Callable[[], Any]) -> int:
    """Peak live bytes during ``step()`` (forward, backward, ``optimizer.step()``, zero_grad).

    Everything alive before the step -- parameters, buffers, gradients and optimizer state --
    is the baseline; storages created by ops during the step are tracked through weak
    references (CPU tensors report no allocator statistics, so this is the live-set peak).
    """
    from trainmem.trace.live import LiveStorages

    tensors = [*model.parameters(), *(p.grad for p in model.parameters()), *model.buffers(),
               *(v for state in optimizer.state.values() for v in state.values())]
    with LiveStorages(tensors) as live:
        step()
    return live.peak


def explain_difference(estimated, saved: list[SavedTensor]) -> str:
    """Where an estimate's items and measured saved tensors disagree, as one line: per
    (bytes, dtype), how many each side has, with the estimate's names and the measured
    ``grad_fn`` names. Zero-byte items (notes such as "not saved") are left out."""
    import collections

    est = collections.Counter((i.bytes, i.dtype) for i in estimated if i.bytes)
    meas = collections.Counter((t.nbytes, t.dtype) for t in saved)
    rows = []
    for key in sorted(set(est) | set(meas)):
        if est[key] != meas[key]:
            names = [i.name for i in estimated if (i.bytes, i.dtype) == key][:3]
            fns = [t.grad_fn for t in saved if (t.nbytes, t.dtype) == key][:3]
            rows.append(f"{key[0]} B {key[1]}: estimate {est[key]}× {names} vs measured {meas[key]}× {fns}")
    return "; ".join(rows)
