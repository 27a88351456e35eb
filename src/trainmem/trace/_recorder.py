"""The private dispatch mode that records every storage allocation and free.

Storages live in a :class:`trainmem.trace.storages.StorageTracker` (keyed by
``untyped_storage()._cdata``, held only through weak references, so recording never changes a
lifetime; DTensors read through their local shard). A storage seen at a new size (an op
output after ``aten.resize_``) is recorded as the caching allocator serves it: the old block is
freed and a block of the new size allocated. Module attribution uses torch's ``ModTracker``
hooks (forward pre/post, multi-grad hooks for backward) with our own push order, so the
innermost active module wins; its multi-grad hooks are removed once fired, so they keep no autograd
graph alive (trace/mod_tracker_hooks.py).

A recording must not depend on what ran before it in the process. The one order found to depend on
memory addresses (NeoX and Llama, fp32 and amp-bf16, LoRA and full, selective and full recompute:
tests/trace/test_trace_process_independent.py) is that of autocast's cast cache:
``torch.clear_autocast_cache`` (called by ``torch.autocast.__exit__`` at nesting 0,
torch/amp/autocast_mode.py, in forward and in each checkpoint's recompute) empties ``cached_casts``, a ``ska::flat_hash_map`` keyed by ``TensorImpl*``
(aten/src/ATen/autocast_mode.cpp ``clear_cache``), so its 16-bit copies die in an order set by
where the allocator placed them. While recording, the frees made by that call are recorded in
allocation order instead: the same set of frees between the same two allocations, in one order.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch
from torch.distributed._tools.mod_tracker import ModTracker
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass

from trainmem.trace.storages import Entry, StorageTracker
from trainmem.trace.low_bit_optim import allocating_paged, is_paged_state
from trainmem.trace.mod_tracker_hooks import ReleasedMultiGradHooks
from trainmem.trace.offload import allocating_on_host
from trainmem.trace.qlora import quantized_parts
from trainmem.trace.torchao_optim import state_parts

__all__: list[str] = []

CUDA_MIN_BLOCK_BYTES = 512  # c10/cuda/CUDACachingAllocator.cpp kMinBlockSize


def round_up(nbytes: int, multiple: int = CUDA_MIN_BLOCK_BYTES) -> int:
    return -(-nbytes // multiple) * multiple


# Where a storage came from, decided while recording; the final category is decided later
# from these plus its lifetime (see result.py).
ORIGIN_PARAMETER = "parameter"
ORIGIN_BUFFER = "buffer"
ORIGIN_GRADIENT = "gradient"
ORIGIN_MASTER = "master_weight"
ORIGIN_STATE = "optimizer_state"
ORIGIN_INPUT = "input"
ORIGIN_OP = "op"
ORIGIN_RECOMPUTE = "recompute"
ORIGIN_FSDP = "fsdp_unsharded"  # FSDP2's gathered parameters, resized in place (trace/parallel_fsdp.py)


@dataclass(slots=True)
class Block:
    """One storage: its size, creator and lifetime in event indices."""

    id: int
    nbytes: int
    size: int  # nbytes rounded up to 512, what the CUDA allocator hands out
    op: str
    module: str
    phase: str
    origin: str
    shape: tuple[int, ...]
    dtype: str
    alloc_at: int
    free_at: int | None = None
    saved: bool = False  # seen by the saved-tensor pack hook
    name: str = ""  # item name for model states and inputs; ops are named ``<module>.<op>``
    stream: int = 0  # the CPU stream current at allocation (0: default; FSDP's side streams: 1, 2, ...)


@dataclass
class Recording:
    """The raw trace: blocks and the event list (``id`` allocates, ``~id`` frees)."""

    blocks: list[Block] = field(default_factory=list)
    events: list[int] = field(default_factory=list)
    marks: list[tuple[int, str]] = field(default_factory=list)  # (event index, phase) when a phase starts
    module_peaks: dict[tuple[str, str], int] = field(default_factory=dict)  # (module, phase) -> bytes
    module_order: list[str] = field(default_factory=list)
    baseline: int = 0  # number of blocks alive at entry (registered, not allocated in the window)
    # bitsandbytes' paged optimizer states (CUDA unified memory, trace/low_bit_optim.py): not in events
    paged: list[Block] = field(default_factory=list)


def _short_op(func) -> str:
    try:
        return func._overloadpacket.__name__
    except AttributeError:
        return getattr(func, "__name__", str(func))


def _inner_tensors(t) -> list:
    """The plain tensors holding a wrapper subclass's bytes (``__tensor_flatten__``, recursively): the
    wrapper's own storage has its nominal size and no memory (a torchao ``Float8Tensor`` made by an op
    under FSDP2's fp8 all-gather is nominally bf16, its ``_data`` fp8)."""
    out = []
    for name in t.__tensor_flatten__()[0]:
        inner = getattr(t, name)
        out += _inner_tensors(inner) if is_traceable_wrapper_subclass(inner) else [inner]
    return out


def _optimizer_phase() -> str:
    """``optimizer``, or ``step_in_backward`` for a step that runs inside backward (a gradient hook,
    ``--optimizer-in-backward``): the estimate's phase names (trainmem.schemas.PHASES)."""
    return "step_in_backward" if torch._C._current_graph_task_id() != -1 else "optimizer"


class _Recorder(TorchDispatchMode):
    """Records allocations of every op output; see the module docstring."""

    def __init__(self, model: torch.nn.Module | None, optimizers=(), progress=None) -> None:
        super().__init__()
        self.rec = Recording()
        # entry.data: the storage's current Block (id -1 while it has no bytes)
        self._storages = StorageTracker(granularity=CUDA_MIN_BLOCK_BYTES, on_free=self._on_free,
                                        on_resize=self._on_resize)
        self._names: dict[int, str] = {}
        if model is not None:
            self._names = {id(m): n for n, m in model.named_modules()}
        self._model = model
        self._optimizers = list(optimizers)
        self._stack: list[str] = []
        self._recompute = 0
        self._in_opt = 0
        self._phase = "forward"
        self._op: str | None = None
        self._open = False
        self._progress = progress
        self._mod_tracker = ModTracker()
        self._multi_grad_hooks = ReleasedMultiGradHooks()  # ModTracker's, freed as in a step without it
        self._handles: list = []
        self._param_keys: set[int] = set()
        self._host_steps: set[int] = set()  # storages of Adam's host-side step counters: never device bytes
        self._resizable: list = []  # (tensor, name) whose storage is resized in place (watch_resizable)
        self._default_stream = torch.cpu.current_stream()
        self._streams: dict[int, int] = {}  # id of a side stream -> its number (_stream)
        self._paged: dict[int, Block] = {}  # unified-memory storages (paged optimizer states), by storage key
        self._held_frees: list[Block] | None = None  # frees recorded at the end of a clear_autocast_cache call
        self._clear_autocast_cache = None  # torch's own, while it is patched (see the module docstring)

    # -- storages ---------------------------------------------------------------
    def _register(self, t: torch.Tensor, origin: str, module: str, op: str = "", name: str = "") -> Block | None:
        entry, new = self._storages.add(t)
        if new:
            entry.data = Block(-1, 0, 0, op, module, self._phase, origin, tuple(t.shape),
                               str(t.dtype).removeprefix("torch."), -1, name=name)
            if entry.nbytes:
                self._open_block(entry)
        return entry.data if entry.data.id >= 0 else None

    def _open_block(self, entry: Entry, op: str | None = None, in_flight: int = 0) -> None:
        """A block of the storage's current size, allocated now (by ``op``), like ``entry.data``
        otherwise; ``in_flight``: bytes of the block it replaces, alive until the copy is done."""
        blk = replace(entry.data, id=len(self.rec.blocks), nbytes=entry.nbytes, size=round_up(entry.nbytes),
                      op=entry.data.op if op is None else op, phase=self._phase, alloc_at=len(self.rec.events),
                      free_at=None, saved=False, stream=self._stream() if self._resizable else 0)
        entry.data = blk
        self.rec.blocks.append(blk)
        self.rec.events.append(blk.id)
        total = self._storages.live_bytes + in_flight
        for mod in self._stack:
            k = (mod, self._phase)
            if total > self.rec.module_peaks.get(k, 0):
                self.rec.module_peaks[k] = total

    def _close_block(self, blk: Block) -> None:
        if blk.id >= 0 and blk.free_at is None:
            blk.free_at = len(self.rec.events)
            self.rec.events.append(~blk.id)

    def _on_free(self, entry: Entry) -> None:
        if self._open:
            if self._held_frees is not None:
                self._held_frees.append(entry.data)
            else:
                self._close_block(entry.data)

    def _clear_autocast_cache_in_order(self) -> None:
        """``torch.clear_autocast_cache`` with the frees it makes recorded in allocation order (no op, so no
        allocation, runs inside it; see the module docstring)."""
        self._held_frees = []
        try:
            self._clear_autocast_cache()
        finally:
            held, self._held_frees = self._held_frees, None
            for blk in sorted(held, key=lambda b: b.id):
                self._close_block(blk)

    def _on_resize(self, entry: Entry, old_nbytes: int) -> None:
        """Like the caching allocator's ``resize_bytes_cuda`` (aten/src/ATen/native/cuda/Resize.cpp):
        the new block is allocated and the contents copied before the old block is freed."""
        if not self._open:
            return
        old = entry.data
        if entry.nbytes:
            self._open_block(entry, self._op, in_flight=old.size if old.id >= 0 else 0)
        self._close_block(old)

    def _current(self) -> str:
        if self._in_opt:
            return "optimizer"
        return self._stack[-1] if self._stack else ""

    def _set_phase(self, phase: str) -> None:
        if phase != self._phase:
            self._phase = phase
            self.rec.marks.append((len(self.rec.events), phase))

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        """torch.compile runs with the recorder on (it would fall back to eager otherwise) and
        the recorder sees the compiled graphs' ops (``trainmem.trace.compiled``)."""
        return True

    def _stream(self) -> int:
        """The CPU stream current now, numbered in order of first use (0: the default stream). FSDP2 enters
        its all-gather and reduce-scatter streams with ``device_handle.stream``, which on CPU is
        ``torch.cpu.stream`` and sets ``torch.cpu.current_stream()`` where a CUDA run switches streams."""
        current = torch.cpu.current_stream()
        if current is self._default_stream:
            return 0
        return self._streams.setdefault(id(current), len(self._streams) + 1)

    def _phase_now(self) -> str:
        if self._in_opt:
            return _optimizer_phase()
        if torch._C._current_graph_task_id() != -1:
            return "backward"
        return "forward" if self._stack or self._phase == "forward" else "other"

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self._resizable:  # FSDP2 resizes storages between ops: seen before the op that fills them
            self._set_phase(self._phase_now())
            self._op = "resize_"  # UntypedStorage.resize_ (_fsdp_param.py alloc_storage), seen at this op
            self._storages.refresh()
        out = func(*args, **(kwargs or {}))
        phase = self._phase_now()
        if phase != self._phase:
            self._set_phase(phase)
        origin = ORIGIN_RECOMPUTE if self._recompute and phase == "backward" else ORIGIN_OP
        if isinstance(out, torch.Tensor):
            self._see(out, func, origin)
        elif isinstance(out, (tuple, list)):
            for o in out:
                if isinstance(o, torch.Tensor):
                    self._see(o, func, origin)
                elif isinstance(o, (tuple, list)):
                    for p in o:
                        if isinstance(p, torch.Tensor):
                            self._see(p, func, origin)
        return out

    def _see(self, t: torch.Tensor, func, origin: str) -> None:
        if allocating_on_host():
            return  # a host copy made by activation offload (trace/offload.py): never device bytes
        if self._host_steps and t.untyped_storage()._cdata in self._host_steps:
            return  # ``step_t += 1`` (adam.py _single_tensor_adam) outputs a host step counter
        if allocating_paged() or (self._paged and t.untyped_storage()._cdata in self._paged):
            self._register_paged(t, func=func)  # unified memory: outside the allocator's events
            return
        self._op = _short_op(func)  # a storage resized by this op is reallocated by it
        parts = quantized_parts(t) if is_traceable_wrapper_subclass(t) else None
        if parts is None and is_traceable_wrapper_subclass(t) and getattr(t, "_local_tensor", None) is None:
            parts = [(None, inner) for inner in _inner_tensors(t)]  # torchao's Float8Tensor (FSDP2 fp8 all-gather)
        for _, inner in parts or ((None, t),):  # a torchao NF4Tensor: its inner storages (trace/qlora.py)
            self._register(inner, origin, self._current(), self._op)

    # -- model states -------------------------------------------------------------
    def _register_states(self) -> None:
        params: set[int] = set()
        if self._model is not None:
            for name, p in self._model.named_parameters(remove_duplicate=True):
                owner = name.rpartition(".")[0]
                for suffix, t in quantized_parts(p) or (("", p),):  # a 4-bit weight's storages (trace/qlora.py)
                    self._register(t, ORIGIN_PARAMETER, owner, name=name + suffix)
                params.add(id(p))
                if p.grad is not None:
                    self._register(p.grad, ORIGIN_GRADIENT, owner, name=name + ".grad")
            for name, b in self._model.named_buffers():
                self._register(b, ORIGIN_BUFFER, name.rpartition(".")[0], name=name)
        for i, opt in enumerate(self._optimizers):
            for g, group in enumerate(opt.param_groups):
                for j, p in enumerate(group["params"]):
                    if id(p) in params:
                        continue
                    label = f"optimizer.{i}.master.{g}.{j}"
                    self._register(p, ORIGIN_MASTER, "optimizer", name=label)
                    if p.grad is not None:
                        self._register(p.grad, ORIGIN_GRADIENT, "optimizer", name=label + ".grad")
            self._register_opt_state(opt, i)
        self._params = params

    def _register_opt_state(self, opt, i: int) -> None:
        names = {}
        if self._model is not None:
            names = {id(p): n for n, p in self._model.named_parameters()}
        for j, (p, state) in enumerate(opt.state.items()):
            base = names.get(id(p), f"optimizer.{i}.param.{j}")
            for k, v in state.items():
                # Adam's 0-dim ``step`` lives on the host on CUDA unless capturable/fused
                if isinstance(v, torch.Tensor) and k == "step" and v.dim() == 0:
                    self._host_steps.add(v.untyped_storage()._cdata)
                elif isinstance(v, torch.Tensor) and is_paged_state(v):
                    self._register_paged(v, name=f"{base}.{k}")
                elif isinstance(v, torch.Tensor):
                    for suffix, t in state_parts(v) or (("", v),):  # torchao's state subclasses: their tensors
                        blk = self._register(t, ORIGIN_STATE, "optimizer", name=f"{base}.{k}{suffix}")
                        if blk is not None and blk.origin == ORIGIN_OP:
                            blk.origin, blk.name = ORIGIN_STATE, f"{base}.{k}{suffix}"

    def _register_paged(self, t: torch.Tensor, *, name: str = "", func=None) -> None:
        """A paged optimizer state (``F.get_paged``'s managed buffer): a block of its own list,
        never an allocation event, so allocated and reserved leave it out."""
        key = t.untyped_storage()._cdata
        blk = self._paged.get(key)
        if blk is None:
            nbytes = t.untyped_storage().nbytes()
            blk = Block(len(self.rec.paged), nbytes, nbytes, _short_op(func) if func else "get_paged", "optimizer",
                        self._phase, ORIGIN_STATE, tuple(t.shape), str(t.dtype).removeprefix("torch."), -1)
            self._paged[key] = blk
            self.rec.paged.append(blk)
        if name:
            blk.name = name

    def mark_input(self, t: torch.Tensor, name: str = "input") -> None:
        blk = self._register(t, ORIGIN_INPUT, "", name=name)
        if blk is not None:
            blk.origin, blk.name = ORIGIN_INPUT, name

    # -- hooks ----------------------------------------------------------------------
    def _name(self, mod) -> str:
        name = self._names.get(id(mod)) if mod is not None else None
        if name is None:
            name = self._mod_tracker.get_known_fqn(mod) if mod is not None else None
            name = name or "<unknown>"
        if name not in self._seen_modules:
            self._seen_modules.add(name)
            self.rec.module_order.append(name)
        return name

    def _tick(self, phase: str) -> None:
        """Progress: one unit per module forward and per module backward."""
        if self._progress is None:
            return
        self._units += 1
        done = min(self._units / self._total_units, 0.99)
        if done - self._shown >= 0.01:
            self._shown = done
            self._progress(done, phase)

    def _pre_fw(self, mod, _inputs) -> None:
        self._stack.append(self._name(mod))
        if torch._C._current_graph_task_id() != -1:
            self._recompute += 1
        else:
            self._tick("forward")

    def _post_fw(self, mod, _inputs, _outputs) -> None:
        name = self._name(mod)
        self._pop(name)
        if torch._C._current_graph_task_id() != -1 and self._recompute:
            self._recompute -= 1

    def _pre_bw(self, mod, _grads) -> None:
        self._stack.append(self._name(mod))
        self._tick("backward")

    def _post_bw(self, mod, _grads) -> None:
        self._pop(self._name(mod))

    def _pop(self, name: str) -> None:
        for i in range(len(self._stack) - 1, -1, -1):
            if self._stack[i] == name:
                del self._stack[i]
                return

    def _pack(self, t: torch.Tensor):
        entry = self._storages.get(t)
        if entry is not None and entry.data.id >= 0:
            entry.data.saved = True
        return t

    def watch_resizable(self, tensors, names) -> None:
        """Storages resized in place between ops (FSDP2's all-gather outputs), followed at every op
        from entry; ``names`` labels each (the unsharded parameter it holds)."""
        self._resizable = list(zip(tensors, names))

    def _name_unit_grads(self) -> None:
        """FSDP's sharded gradients are views of one reduce-scatter output per unit: claimed by the
        gradient hooks FSDP2 runs itself (``foreach_reduce``, _fsdp_collectives.py), assigned by FSDP1
        (``_reduce_grad``, _runtime_utils.py: the flat parameter's ``.grad``, the original parameters'
        views of it) without a hook. Each such storage is a gradient, named after the unit's module
        prefix (``model.layers.0.grads``) rather than one of its parameters."""
        by_key: dict[int, list[str]] = {}
        blocks = {}
        for name, p in self._model.named_parameters():
            entry = self._storages.get(p.grad) if p.grad is not None else None
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

    def _opt_pre(self, opt, args, kwargs) -> None:
        if self._resizable and self._model is not None and not self._in_opt:
            self._name_unit_grads()
        self._in_opt += 1
        self._set_phase(_optimizer_phase())

    def _opt_post(self, opt, args, kwargs) -> None:
        self._in_opt -= 1
        for i, o in enumerate(self._optimizers):
            if o is opt:
                self._register_opt_state(o, i)

    def _grad_hook(self, name: str):
        def hook(p) -> None:
            if p.grad is not None:
                blk = self._register(p.grad, ORIGIN_GRADIENT, self._current(), name=name + ".grad")
                if blk is not None:
                    blk.origin, blk.name = ORIGIN_GRADIENT, name + ".grad"
        return hook

    def __enter__(self):
        self._seen_modules: set[str] = set()
        self._units, self._shown = 0, 0.0
        self._total_units = 2 * max(len(self._names), 1)
        self._open = True
        self._register_states()
        for t, name in self._resizable:
            self._register(t, ORIGIN_FSDP, name.rpartition(".")[0], name=name + ".unsharded")
            self._storages.add(t, resizable=True)
        self.rec.baseline = len(self.rec.blocks)
        self.rec.marks.append((len(self.rec.events), self._phase))
        if self._model is not None:
            for name, p in self._model.named_parameters():
                if p.requires_grad:
                    self._handles.append(p.register_post_accumulate_grad_hook(self._grad_hook(name)))
        for i, opt in enumerate(self._optimizers):
            for g, group in enumerate(opt.param_groups):
                for j, p in enumerate(group["params"]):
                    if id(p) not in self._params and p.requires_grad:
                        hook = self._grad_hook(f"optimizer.{i}.master.{g}.{j}")
                        self._handles.append(p.register_post_accumulate_grad_hook(hook))
        self._handles.append(register_optimizer_step_pre_hook(self._opt_pre))
        self._handles.append(register_optimizer_step_post_hook(self._opt_post))
        self._mod_tracker.register_user_hooks(self._pre_fw, self._post_fw, self._pre_bw, self._post_bw)
        self._multi_grad_hooks.__enter__()
        self._mod_tracker.__enter__()
        self._saved_hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self._saved_hooks.__enter__()
        entered = super().__enter__()
        self._clear_autocast_cache = torch.clear_autocast_cache
        torch.clear_autocast_cache = self._clear_autocast_cache_in_order
        return entered

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            if self._clear_autocast_cache is not None:
                torch.clear_autocast_cache, self._clear_autocast_cache = self._clear_autocast_cache, None
            self._saved_hooks.__exit__(*exc)
            self._mod_tracker.__exit__(*exc)
            self._mod_tracker.clear_user_hooks()
            self._multi_grad_hooks.__exit__(*exc)
            for h in self._handles:
                h.remove()
            self._handles.clear()
            self._open = False
            if self._progress is not None:
                self._progress(1.0, "done")
            self._storages.close()
