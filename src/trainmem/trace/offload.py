"""Activation offloading to host memory, as torchtune does it, runnable on CPU and fake tensors.

torchtune/training/_activation_offloading.py (torchtune bd2a0fc) ``OffloadActivations``, a
``saved_tensors_hooks`` pair, with its defaults (``use_streams=True``, ``max_fwd_stash_size=5``,
``min_offload_size=1024``), and ``get_act_offloading_ctx_manager``, which turns the hooks off
(``NoOpManager``) inside the output projection; torchtune's recipes compute the loss outside the
context (recipes/full_finetune_single_device.py ``_loss_step``). :class:`OffloadActivations` here
follows that code's policy and bookkeeping; only the CUDA mechanics are replaced:

* **pack** (forward): a saved tensor of at least ``min_offload_size`` bytes (``element_size ×
  nelement`` of the tensor as saved, a view counts its own elements) that is not an
  ``nn.Parameter`` / ``nn.Buffer`` instance is copied to a new host tensor; autograd keeps only
  an id. A view of a parameter (``weight.t()``, what ``mm`` saves for a linear layer) is not an
  ``nn.Parameter`` instance, so it is copied too -- as torchtune does. Every pack is its own copy
  (a tensor saved by three ops is copied three times). Smaller tensors and parameters stay.
  With streams the device tensor is kept in the forward stash until ``max_fwd_stash_size``
  later packs have happened (the copy must finish before the memory is reused).
* **unpack** (backward): the host copy is brought back as a new device tensor (freeing the host
  copy), unless the tensor is still in the forward stash. With streams the brought-back tensor
  stays alive until the *next* autograd node that brings tensors back has run (its hook frees the
  previous node's), and the forward stash is emptied by the first such hook.

Device and host on one CPU: a host copy is made inside :func:`on_host`, which the tracer's
recorder (``trace/_recorder.py``) and :class:`~trainmem.trace.live.LiveStorages` read, so it
never counts as device memory; its bytes are counted here (``host``: live and peak).
``torch.cuda`` streams and events have no CPU counterpart: waits are no-ops, so what is alive
when is decided by the references the real code holds, which are kept exactly.

Known limitations:
  - pinned host memory (``use_pin_memory``) is plain host memory here;
  - ``record_stream`` (a brought-back tensor that outlives its node) is modelled as torchtune's
    Python does it: the stash reference is dropped; the caching allocator's delayed reuse is not.
"""

from __future__ import annotations

import contextlib
from typing import Any

from trainmem.trace.scoped_flag import ScopedFlag

__all__ = ["OffloadActivations", "offload_activations", "on_host", "allocating_on_host", "offload_region"]

MIN_OFFLOAD_BYTES = 1024  # torchtune OffloadActivations(min_offload_size=1024)
MAX_FWD_STASH = 5  # torchtune OffloadActivations(max_fwd_stash_size=5)

_flag = ScopedFlag()
allocating_on_host = _flag.active
"""True while an offload hook makes a host copy (its storage is not device memory)."""
on_host = _flag.scope


def _offloadable(t, min_bytes: int) -> bool:
    """torchtune's test in ``pack_tensor`` (its device-type check is always true here)."""
    import torch
    if t.element_size() * t.nelement() < min_bytes:
        return False
    return not isinstance(t, torch.nn.Parameter) and not (hasattr(torch.nn, "Buffer") and isinstance(t, torch.nn.Buffer))


class OffloadActivations:
    """torchtune's ``OffloadActivations`` on one CPU (see the module docstring). Use as a context
    manager around the forward (or :func:`offload_activations` on a model). ``packed_bytes`` and
    ``offloaded_bytes`` sum every pack and every host copy; ``offloaded_storage_bytes`` the device
    storages copied out, each once, parameters' views aside (``parameter_copy_bytes``, per copy);
    ``host`` tracks the host copies alive."""

    def __init__(self, *, use_streams: bool = True, max_fwd_stash_size: int = MAX_FWD_STASH,
                 min_offload_size: int = MIN_OFFLOAD_BYTES) -> None:
        import torch
        from trainmem.trace.storages import StorageTracker

        if max_fwd_stash_size < 1:
            raise ValueError(f"max_fwd_stash_size should be at least 1 but is {max_fwd_stash_size}")
        self.use_streams, self.max_stash, self.min_bytes = use_streams, max_fwd_stash_size, min_offload_size
        self.tracker: dict[int, tuple[Any, bool]] = {}  # id -> (host copy or the tensor itself, offloaded)
        self.fwd_stash: dict[int, Any] = {}  # id -> device tensor kept while its copy "runs"
        self.bwd_stash: dict[int, Any] = {}  # id -> device tensor brought back
        self.next_id = 0
        self.curr_graph: int | None = None
        self.curr_node = None
        self.first_backward = True
        self.host = StorageTracker()
        self._sources = StorageTracker()  # device storages copied out, each counted once while alive
        self.packed_bytes = 0
        self.offloaded_bytes = 0
        self.offloaded_storage_bytes = 0
        self.parameter_copy_bytes = 0
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def __enter__(self) -> "OffloadActivations":
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)

    def reset(self) -> None:
        """Start the byte counts and the host peak from now (a traced step after a warm-up)."""
        from trainmem.trace.storages import StorageTracker
        self.packed_bytes = self.offloaded_bytes = self.offloaded_storage_bytes = self.parameter_copy_bytes = 0
        self._sources = StorageTracker()
        self.host.reset_peak()

    def report(self) -> dict:
        """What went to host memory: per pack (every copy torchtune makes) and at most at once."""
        return {"policy": "torchtune OffloadActivations", "use_streams": self.use_streams,
                "max_fwd_stash_size": self.max_stash, "min_offload_size": self.min_bytes,
                "packed_bytes": self.packed_bytes, "offloaded_bytes": self.offloaded_bytes,
                "offloaded_storage_bytes": self.offloaded_storage_bytes,
                "parameter_copy_bytes": self.parameter_copy_bytes,
                "host_peak_bytes": self.host.peak_bytes}

    # -- forward ----------------------------------------------------------------------
    def _pack(self, t) -> int:
        import torch
        from trainmem.trace.storages import is_parameter
        if not self.first_backward:  # the first pack after a backward (torchtune: is_first_forward_call)
            self.first_backward = True
        self.next_id += 1
        tid = self.next_id
        nbytes = t.element_size() * t.nelement()
        self.packed_bytes += nbytes
        if not _offloadable(t, self.min_bytes):
            self.tracker[tid] = (t, False)
            return tid
        if self.use_streams:  # stash entries old enough to be copied are released, oldest first
            for old in list(self.fwd_stash):
                if old > tid - self.max_stash:
                    break
                del self.fwd_stash[old]
        with on_host():
            host = torch.empty_like(t, device="cpu")
            host.copy_(t)
        self.host.add(host)
        self.offloaded_bytes += nbytes
        if is_parameter(t):  # a parameter's view (``weight.t()``): the parameter stays anyway
            self.parameter_copy_bytes += nbytes
        elif self._sources.add(t)[1]:
            self.offloaded_storage_bytes += t.untyped_storage().nbytes()
        self.tracker[tid] = (host, True)
        if self.use_streams:
            self.fwd_stash[tid] = t
        return tid

    # -- backward ---------------------------------------------------------------------
    def _bring_back(self, host):
        return host.clone()  # torchtune: host.to(device, non_blocking=True), a new device tensor

    def _unpack(self, tid: int):
        import torch
        if self.first_backward:
            self.first_backward = False
            if self.use_streams:
                self.curr_graph = torch._C._current_graph_task_id()
                torch.autograd.Variable._execution_engine.queue_callback(self._release_all)
        held, offloaded = self.tracker.pop(tid)
        if not offloaded:
            return held
        if not self.use_streams:
            return self._bring_back(held)
        node = torch._C._current_autograd_node()
        prev: list[int] = []
        if torch._C._current_graph_task_id() == self.curr_graph and node is not self.curr_node:
            self.curr_node = node
            prev = list(self.bwd_stash)
        from_host = tid not in self.fwd_stash
        if from_host:
            out = self._bring_back(held)
            self.bwd_stash[tid] = out
            uses = torch._C._storage_Use_Count(out.untyped_storage()._cdata)
        else:
            out = self.fwd_stash[tid]
        del held

        def after_node(outputs, inputs):
            if from_host and tid in self.bwd_stash:
                if torch._C._storage_Use_Count(self.bwd_stash[tid].untyped_storage()._cdata) > uses:
                    del self.bwd_stash[tid]  # torchtune: record_stream, then drop the reference
            self.fwd_stash.clear()
            for old in prev:
                self.bwd_stash.pop(old, None)
            return outputs

        node.register_hook(after_node)
        return out

    def _release_all(self) -> None:
        self.bwd_stash.clear()


def offload_region(model):
    """The module torchtune's context covers (its ``model(**batch)`` without ``model.output``):
    a Hugging Face model's base model (embeddings, blocks, final norm); the LM head and the loss,
    which a Hugging Face model computes in its own forward, stay outside as in torchtune. A peft model is unwrapped
    first (peft/peft_model.py ``PeftModel.get_base_model``): its own ``base_model`` is the ``LoraModel`` tuner,
    whose hooks the step never fired, so LoRA's step offloaded nothing (measured: packed_bytes 0)."""
    if hasattr(model, "get_base_model"):
        model = model.get_base_model()
    base = getattr(model, "base_model", None)
    return base if base is not None and base is not model else model


@contextlib.contextmanager
def offload_activations(model, **kwargs):
    """Offload what ``model``'s :func:`offload_region` saves, for every forward inside the block.
    Yields the :class:`OffloadActivations` (its ``host`` tracker and byte counts)."""
    hooks = OffloadActivations(**kwargs)
    region = offload_region(model)

    def enter(*_args) -> None:  # a pre-hook's return value would replace the inputs
        hooks.__enter__()

    def leave(*_args) -> None:
        hooks.__exit__(None, None, None)

    handles = [region.register_forward_pre_hook(enter), region.register_forward_hook(leave, always_call=True)]
    try:
        yield hooks
    finally:
        for h in handles:
            h.remove()
