"""Per-tensor activation items of a measured step, keyed like the estimate's and the trace's.

During the first micro-batch's forward of the instrumented step, :class:`ForwardTensors` records
metadata only -- never a tensor -- so the step's memory is what it would be without it:

* a dispatch mode (:func:`trainmem.trace.storages.dispatch_mode`) numbers every storage an op
  creates, in creation order, with the innermost module running its forward (module forward
  pre/post hooks), the op, shape, dtype and bytes; storages are held through weak references in
  a :class:`~trainmem.trace.storages.StorageTracker`, whose entries leave when a storage dies;
* ``saved_tensors_hooks`` (as :func:`trainmem.trace.saved.saved_tensors`) mark the storages autograd
  packs for backward; the pack hook returns the tensor itself and keeps nothing;
* when the forward ends (``loss`` computed, before ``backward``), the storages created in it and
  still alive are the activations, as the tracer counts them (``trace/result.py`` ``categorize``:
  forward blocks alive when backward starts); tensors saved for backward that no op of the
  forward created (the token ids the embedding keeps) are inputs, keyed ``(inputs)``, at the bytes
  of the tensor saved (a micro-batch's ids are a view of the caller's whole batch, held anyway).

Items are named as the trace names them (``<module path>.<aten op>``, ``:k`` from the second
repeat on, ``trace/result.py`` ``item_names``) and keyed with :func:`trainmem.join.activation_keys`:
``<module>:<bytes>B:<k>``, so the estimate's, the trace's and the measurement's activations join
tensor by tensor (:func:`trainmem.join.join_sides`).

Known limitations: tensors made inside a ``torch.utils.checkpoint`` region and dropped by it are
not activations (right), but the hooks do not see what the region packs, so the note "saved for
backward" is only given outside such regions; a storage resized after it was made is counted at
its size when the forward ends.
"""

from __future__ import annotations

from dataclasses import dataclass

from trainmem.inventory import Category, MemoryItem
from trainmem.trace.recording import short_op

__all__ = ["ForwardTensors", "INPUT_PREFIX", "item_from_dict"]

INPUT_PREFIX = "(inputs)."  # trainmem.join.INPUTS: the module of what the caller made


@dataclass
class _Made:
    seq: int
    module: str
    op: str
    shape: tuple[int, ...]
    dtype: str
    saved: bool = False


_ALIASES: dict = {}


def _aliases(func) -> bool:
    """The op returns a view of (or writes into) an input: its schema gives a return alias info
    (``aten.view``, ``aten.add_``, ``out=``). Such an output's storage was made before the op."""
    out = _ALIASES.get(func)
    if out is None:
        schema = getattr(func, "_schema", None)
        out = _ALIASES[func] = schema is not None and any(r.alias_info is not None for r in schema.returns)
    return out


def _dtype(t) -> str:
    return str(t.dtype).removeprefix("torch.")


class ForwardTensors:
    """Record one forward; :meth:`start` and :meth:`stop` bracket it, :attr:`items` is the result.

    ``inputs`` names tensors the caller made (``{"input_ids": ids}``); other saved tensors that no
    op of the forward made and that are not parameters or buffers of ``model`` are ``input``."""

    def __init__(self, model, inputs: dict | None = None) -> None:
        from trainmem.trace.storages import StorageTracker, local, storage_key

        self.model = model
        self.items: tuple[MemoryItem, ...] = ()
        self._storages = StorageTracker()
        self._inputs = {storage_key(t): n for n, t in (inputs or {}).items() if t is not None}
        self._states: set[int] = set()
        if model is not None:
            self._states = {storage_key(t) for t in (*model.parameters(), *model.buffers())}
        self._external: dict[int, tuple[str, tuple[int, ...], str, int, object]] = {}
        self._local = local
        self._stack: list[str] = []
        self._seq = 0
        self._handles: list = []
        self._contexts: list = []
        self.started = self.stopped = False

    # -- hooks -----------------------------------------------------------------------------
    def _module_hooks(self) -> None:
        if self.model is None:
            return
        for name, mod in self.model.named_modules():
            name = "" if name == "module" else name.removeprefix("module.")  # DDP's wrapper
            self._handles.append(mod.register_forward_pre_hook(self._push(name)))
            self._handles.append(mod.register_forward_hook(self._pop(name)))

    def _push(self, name: str):
        def hook(mod, args) -> None:
            self._stack.append(name)
        return hook

    def _pop(self, name: str):
        def hook(mod, args, out) -> None:
            for i in range(len(self._stack) - 1, -1, -1):  # innermost first, as trace/attribution.py ModuleStack._pop
                if self._stack[i] == name:
                    del self._stack[i]
                    return
        return hook

    def _after_op(self, func, tensors: list) -> None:
        from trainmem.trace.offload import allocating_on_host
        if allocating_on_host():
            return  # a host copy made by activation offload: not device memory (as trace/live.py)
        if _aliases(func):
            return  # a view or an in-place/out= result: an input's storage, made by no op here
        for t in tensors:
            key = self._local(t).untyped_storage()._cdata
            if key in self._states:
                continue
            entry, new = self._storages.add(t)
            if new:
                lt = self._local(t)
                op = short_op(func)
                entry.data = _Made(self._seq, self._stack[-1] if self._stack else "", op, tuple(lt.shape), _dtype(lt))
                self._seq += 1

    def _pack(self, t):
        lt = self._local(t)
        try:
            key = lt.untyped_storage()._cdata
        except (RuntimeError, NotImplementedError, TypeError):
            return t  # a wrapper subclass with no storage of its own: nothing to record, the step runs on
        entry = self._storages.entries.get(key)
        if entry is not None:
            entry.data.saved = True
        elif key not in self._states and (key not in self._external or self._external[key][4]() is None):
            import weakref  # (a dead storage's key may be reused by a new one)
            st = lt.untyped_storage()
            # the tensor saved, not its storage: a micro-batch is a view of the caller's whole batch
            self._external[key] = (self._inputs.get(key, "input"), tuple(lt.shape), _dtype(lt),
                                   lt.numel() * lt.element_size(),
                                   weakref.ref(st))
        return t  # nothing is kept: the tensor goes to autograd as it came

    # -- the bracket -----------------------------------------------------------------------
    def start(self) -> None:
        import torch

        from trainmem.trace.storages import dispatch_mode

        if self.started:
            return
        self.started = True
        self._module_hooks()
        for ctx in (torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t), dispatch_mode(self._after_op)):
            ctx.__enter__()
            self._contexts.append(ctx)

    def stop(self) -> None:
        """End the record (the forward returned): list the activations and let go of everything."""
        if not self.started or self.stopped:
            return
        self.stopped = True
        self.close()
        made = [(e.data, e.nbytes) for e in self._storages.entries.values() if e.nbytes]
        made.sort(key=lambda m: m[0].seq)
        ext = [(n, shape, dt, nb) for n, shape, dt, nb, ref in self._external.values() if ref() is not None and nb]
        self._storages.close()
        self._external.clear()
        self.items = _items(made, ext)

    def close(self) -> None:
        """Leave the dispatch mode and the hooks (innermost first); safe to call twice."""
        while self._contexts:
            self._contexts.pop().__exit__(None, None, None)
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def on(self, event: str) -> None:
        """A step's probe (``trainmem.measure.workload.Probe``): forward_start starts, forward_end stops."""
        if event == "forward_start":
            self.start()
        elif event == "forward_end":
            self.stop()


def _items(made: list, external: list) -> tuple[MemoryItem, ...]:
    """Name (as ``trace/result.py`` ``item_names``) and key (``trainmem.join.activation_keys``) the records."""
    from trainmem.join import activation_keys

    rows = [(f"{m.module}.{m.op}" if m.module else m.op, m.shape, m.dtype, nb, f"aten.{m.op}",
             "saved for backward" if m.saved else "alive at backward start (not seen by saved-tensor hooks)")
            for m, nb in made]
    rows += [(INPUT_PREFIX + n, shape, dt, nb, "", "input saved for backward") for n, shape, dt, nb in external]
    names, seen = [], {}
    for base, *_ in rows:
        k = seen.get(base, 0)
        seen[base] = k + 1
        names.append(f"{base}:{k}" if k else base)
    keys = activation_keys(names, range(len(rows)), [r[3] for r in rows], estimate=False)
    return tuple(MemoryItem(name=n, category=Category.ACTIVATION, shape=shape, dtype=dt, bytes=nb, formula=formula,
                            note=note, key=key)
                 for n, (_, shape, dt, nb, formula, note), key in zip(names, rows, keys))


def item_from_dict(d: dict) -> MemoryItem:
    """The inverse of ``MemoryItem.to_dict`` (the key is kept only where it differs from the name)."""
    return MemoryItem(name=d["name"], category=Category(d["category"]), shape=tuple(d.get("shape", ())),
                      dtype=d.get("dtype", ""), bytes=d["bytes"], formula=d.get("formula", ""), note=d.get("note", ""),
                      dims=tuple(d.get("dims", ())), key="" if d.get("key") == d["name"] else d.get("key", ""))
