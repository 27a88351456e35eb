"""Run the cut model's forward on fake tensors at a few (B, S) and list what it keeps for backward.

One model is built in one ``FakeTensorMode`` (CPU fake tensors: shapes and dtypes, no data) and
run once per point: forward and loss under trainmem's recorder (``trace/_recorder.py``), as
``trace_step`` runs them (``trace/step.py``: precision, autocast, attention kernel, recompute,
MoE routing). What the step keeps for backward is every storage an op made during forward that
is still alive when forward returns -- saved by autograd, or held by a checkpoint region -- plus
the inputs autograd saved (the token ids, by the embedding), and the loss itself (``loss.value``: the
caller holds it until backward is done, estimate/loss_value.py); a buffer autograd
saves (Gemma's ``embed_scale``) is the buffer item, not an activation.

Known limitations: CPU kernels only (``--device cpu``); the saved set is that of transformers'
modules as installed.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, replace
from typing import Any, Mapping, Sequence

from trainmem.errors import UnsupportedError
from trainmem.specs import ImplSpec, StepSpec

__all__ = ["Saved", "record_saved"]


@dataclass(frozen=True)
class Saved:
    """One storage kept for backward at one (B, S)."""

    name: str  # <module path>.<op>, ``_<n>`` from the second of a name on; ``loss.`` for the root's ops
    op: str
    shape: tuple[int, ...]
    dtype: str
    nbytes: int
    held: bool = False  # not kept for backward: alive in the last stack's scope at its end (see _held)
    output: bool = False  # not kept for backward: held by the model's output through the loss (see _output_held)


def record_saved(config: Mapping[str, Any], step: StepSpec, impl: ImplSpec,
                 points: Sequence[tuple[int, int]], prepare=None) -> list[list[Saved]]:
    """What one forward keeps for backward at each (B, S) of ``points``, in allocation order.
    ``prepare(model)``, if given, runs on the built fake model first (``tp.localize``: one TP rank's shapes)."""
    import torch
    from torch._subclasses import fake_tensor as ft
    from torch._subclasses.fake_tensor import FakeTensorMode

    from trainmem.trace import step as ts
    from trainmem.trace.hf_masks import masks_as_on_real_tensors
    from trainmem.trace.recompute import enable_recompute, selective_recompute
    from trainmem.trace.torch_state import default_dtype, quiet_fake_tensor_log, torch_dtype

    ts._check(step, impl)
    try:
        with quiet_fake_tensor_log(), FakeTensorMode(), ts._attention_context(impl):
            from trainmem.models.hf import build_hf_model
            with default_dtype(torch_dtype(step.dtypes.param)):
                model = build_hf_model(config, attention=impl.attention, init_weights=False)
            model.train()
            if prepare is not None:
                prepare(model)
            enable_recompute(model, impl)
            routing, _ = ts._routing(model, impl, fake=True)
            selective = (selective_recompute(model, impl.attention) if impl.recompute == "selective"
                         else contextlib.nullcontext())
            with routing, selective, masks_as_on_real_tensors():
                return [_one(model, replace(step, batch=b, seq=s), torch) for b, s in points]
    except (ft.DynamicOutputShapeException, ft.DataDependentOutputException) as exc:
        raise UnsupportedError(f"--profile traced: op {exc.func} has a data-dependent output on fake tensors") from None
    except ft.UnsupportedOperatorException as exc:
        raise UnsupportedError(f"--profile traced: op {exc.func} has no fake-tensor implementation") from None
    except (RuntimeError, IndexError, NotImplementedError) as exc:
        first = str(exc).strip().splitlines()[0][:300] if str(exc).strip() else type(exc).__name__
        raise UnsupportedError(f"--profile traced: the model cannot run on fake tensors: {first}") from None


def _one(model, step: StepSpec, torch) -> list[Saved]:
    from trainmem.names import embedding_indices
    from trainmem.trace import step as ts
    from trainmem.trace._recorder import _Recorder
    from trainmem.trace.recording import ORIGIN_INPUT, ORIGIN_OP
    from trainmem.trace.torch_state import torch_dtype

    ts._check_positions(model, step.seq)
    inputs = ts._inputs(model, step, ts._head_of(model))
    ids = inputs.pop("input_ids")
    dt = step.dtypes
    autocast = torch.autocast("cpu", dtype=torch_dtype(dt.activation)) if dt.autocast else contextlib.nullcontext()
    rec = _Recorder(model, [])
    modules = {id(m): n for n, m in model.named_modules()}
    scope, times = _stack_scope(model), {}
    # named as the hf rules name them (trainmem.names): the token ids the token embedding keeps, and
    # each embedding module's output (by block id: a hook holding the tensor would keep it alive)
    outputs: dict[int, str] = {}
    hooks = [m.register_forward_hook(_name_output(rec, outputs, n, torch)) for n, m in model.named_modules()
             if isinstance(m, torch.nn.Embedding)]
    hooks += [m.register_forward_pre_hook(_name_model_ids(rec, outputs, n, torch)) for n, m in model.named_modules()
              if isinstance(m, torch.nn.Embedding)]
    if scope is not None:  # the last stack's entry, and the return of the last module it calls
        hooks.append(scope.register_forward_pre_hook(lambda *_: times.__setitem__("start", len(rec.rec.events))))
        hooks += [m.register_forward_hook(lambda *_: times.__setitem__("end", len(rec.rec.events)))
                  for m in scope.modules() if m is not scope]
    head = model.get_output_embeddings()
    if head is not None:  # the head's first call, and the root's return (its frame's locals gone)
        hooks.append(head.register_forward_pre_hook(_mark(times, "head", rec, first=True)))
        hooks.append(model.register_forward_hook(_mark(times, "returned", rec)))
    with rec, _removed(hooks):
        token = modules.get(id(model.get_input_embeddings()))
        rec.mark_input(ids, embedding_indices(token) if token else "input_ids")
        for key, t in inputs.items():
            if t is not ids:
                rec.mark_input(t, key)
        with autocast:
            loss = model(ids, **inputs).loss  # the output object is dropped here, autocast's cache at the exit
            times["dropped"] = len(rec.rec.events)
        loss_block = rec.book.block_of(loss)
        kept = [b for b in rec.rec.blocks[rec.rec.baseline:]
                if b.free_at is None and b.phase == "forward"
                and (b.origin == ORIGIN_OP or (b.origin == ORIGIN_INPUT and b.saved))]
        # a buffer autograd saves as it is (Gemma's embed_scale) is not kept here: it is the buffer item
        # (estimate/buffers.py), counted once, as `trainmem trace` files it
        held = _held(rec.rec.blocks[rec.rec.baseline:], kept, times, ORIGIN_OP)
        by_output = _output_held(rec.rec.blocks[rec.rec.baseline:], kept, times, ORIGIN_OP)
        del loss
    seen: dict[str, int] = {}
    out = []
    for b in kept:
        own = b.module and not _loss_module(b.module, model, torch)
        base = "loss.value" if b is loss_block else (
            outputs.get(b.id) or b.name or (f"{b.module}.{b.op}" if own else f"loss.{b.op.lstrip('_')}"))
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.append(Saved(base if n == 0 else f"{base}_{n}", b.op or "input", tuple(b.shape), b.dtype, b.nbytes))
    out += [Saved(f"{b.module}.{b.op}#{k}", b.op, tuple(b.shape), b.dtype, b.nbytes, held=True)
            for k, b in enumerate(held)]
    out += [Saved(f"{b.module}.{b.op}#{k}", b.op, tuple(b.shape), b.dtype, b.nbytes, output=True)
            for k, b in enumerate(by_output)]
    return out


def _stack_scope(model):
    """An encoder-decoder's last stack module (T5's ``decoder``, BART's ``model.decoder``), else None."""
    from trainmem.estimate.traced.kinds import find_stacks

    stacks = find_stacks(model)
    return model.get_submodule(stacks[-1].prefix[:-1].rpartition(".")[0]) if len(stacks) > 1 else None


def _held(blocks, kept, times: dict, origin_op: str) -> list:
    """What the last stack holds at its last module's return besides what backward keeps: the
    storages it made that are alive then and gone when forward returns. T5's stack keeps its
    position biases, its input embeddings and masks in locals through the block loop, and the KV
    cache it returns (transformers ``modeling_t5.py`` ``T5Stack.forward``); with them its final
    norm's output and the dropout's (the step's largest forward moment at a small vocabulary)."""
    if "start" not in times or "end" not in times:
        return []
    t0, t1, keep = times["start"], times["end"], {id(b) for b in kept}
    return [b for b in blocks if b.origin == origin_op and b.phase == "forward" and id(b) not in keep
            and t0 <= b.alloc_at < t1 and (b.free_at is None or b.free_at >= t1)]


def _mark(times: dict, key: str, rec, *, first: bool = False):
    """A module hook writing the recorder's event count under ``key`` (``first``: at its first call only); it
    returns None, so it changes neither the module's inputs nor its output."""
    def hook(*_) -> None:
        if not (first and key in times):
            times[key] = len(rec.rec.events)
    return hook


def _output_held(blocks, kept, times: dict, origin_op: str) -> list:
    """What the model's output holds through the loss besides what backward keeps: the storages its modules made
    before the head that outlive the root's forward (its locals gone) and go when the caller drops the output, after
    the loss. MiniMax's cache (``MiniMaxModel.forward`` builds one: ``use_cache`` defaults to True) keeps each
    lightning-attention layer's last ``attn_weights_inter`` (``MiniMaxLightningAttention.forward``, transformers
    ``modeling_minimax.py``), and through its graph the last block's ``K.T @ V`` inputs (the contiguous copies the
    matmul saved), which no loss gradient reads: 589,824 B at hidden 256, B=2, S=256 (a (2, 4, 64, 64) state and
    two (2, 4, 64, 256) copies, bf16). A ``DynamicCache``'s K/V copies that attention saves are kept, not here; the
    logits (made by the head) are ``peak.py``'s; autocast's cached casts go at its exit, after the output."""
    if not {"head", "returned", "dropped"} <= times.keys():
        return []
    keep = {id(b) for b in kept}
    return [b for b in blocks if b.origin == origin_op and b.phase == "forward" and id(b) not in keep
            and b.module and b.alloc_at < times["head"] and b.free_at is not None
            and times["returned"] <= b.free_at < times["dropped"]]


def _name_output(rec, names: dict[int, str], module: str, torch):
    """A forward hook naming the block of ``module``'s output ``<module>.out`` (its first call)."""
    from trainmem.names import embedding_output

    def hook(_mod, _args, out) -> None:
        blk = rec.book.block_of(out) if isinstance(out, torch.Tensor) else None
        if blk is not None:
            names.setdefault(blk.id, embedding_output(module))
    return hook


def _name_model_ids(rec, names: dict[int, str], module: str, torch):
    """A forward pre-hook naming ids the root module made for ``module`` to embed ``<module>.model_ids``, not the
    loss's: T5's decoder input ids, ``input_ids.new_zeros(...)`` in ``T5ForConditionalGeneration._shift_right``
    (transformers ``modeling_t5.py``), filled from the labels by the root before its decoder runs. A root op is
    otherwise filed under ``loss.`` (:func:`_one`), so ``peak.py`` left these ids out of the decoder stack's end
    (``stack_end``, as a head tensor not yet made) and out of the loss's backward (as the loss's int64 target):
    4,096 B under the trace at B=2, S=256 (d_model 256), 16,384 B at t5-small's B=4, S=512. The embedding keeps
    them until its backward in the decoder, which runs before the encoder's blocks': not an ``.indices`` name
    (those the token embedding's backward, the last, frees), ``peak.py`` frees them before the end phase."""
    def hook(_mod, args) -> None:
        ids = args[0] if args and isinstance(args[0], torch.Tensor) else None
        blk = rec.book.block_of(ids) if ids is not None else None
        if blk is not None and not blk.module and not blk.name:
            names.setdefault(blk.id, f"{module}.model_ids")
    return hook


@contextlib.contextmanager
def _removed(handles: list):
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def _loss_module(module: str, model, torch) -> bool:
    """A torch loss module made inside the model's forward, named by its class, not a path of the
    model (T5's ``CrossEntropyLoss(ignore_index=-100)``, transformers ``modeling_t5.py``
    ``T5ForConditionalGeneration.forward``): its ops are the loss's, as a decoder's loss function's."""
    cls = getattr(torch.nn, module, None)
    if not (isinstance(cls, type) and issubclass(cls, torch.nn.modules.loss._Loss)):
        return False
    try:
        model.get_submodule(module)
    except AttributeError:
        return True
    return False
