"""``--compile``: what ``torch.compile`` saves for backward, traced without generating code.

With ``torch.compile``, AOTAutograd traces each compiled region's forward and backward as one
joint graph and a partitioner decides which forward values the backward gets (the rest it
recomputes) before any kernel is generated. Inductor partitions with
``min_cut_rematerialization_partition(compiler="inductor")`` after its joint-graph passes, on a
graph decomposed with its own table (``torch/_inductor/compile_fx.py``: ``partition_fn``,
``compile_fx`` passing ``select_decomp_table()`` to ``aot_autograd``). The min-cut keeps what
is cheapest to hold and recomputes cheap pointwise ops in backward
(``torch/_functorch/partitioners.py`` ``min_cut_rematerialization_partition``,
``choose_saved_values_set``).

:func:`compile_model` compiles a model with the ``trainmem_partition`` backend: the same
decompositions, joint-graph passes and partition as inductor, and then no code generation: each
partitioned forward and backward graph runs as its own ``GraphModule`` under the boxed calling
convention (``torch/_dynamo/backends/debugging.py`` ``boxed_nop``, ``aot_eager``'s compiler): a
backward frees each saved tensor after its last use, as inductor's code does. It needs no C++ compiler and runs on
fake tensors (Dynamo traces under the tracer's ``FakeTensorMode``), so a compiled step is traced
at the real size like an eager one. Each region's saved values (the backward graph's inputs other
than its tangents) are recorded as :class:`SavedValue` s.

:func:`report` measures what each mode really hands to autograd: the same forward run eagerly
and compiled under ``saved_tensors_hooks`` (:func:`trainmem.trace.saved.saved_tensors`: distinct
storages, parameters excluded). A compiled region saves with ``ctx.save_for_backward``
(``torch/_functorch/_aot_autograd/runtime_wrappers.py``), so both are seen the same way.

Known limitations:
  - The saved set is inductor's; the transient memory is not. Inductor fuses pointwise chains
    into kernels whose intermediates never exist, and plans its buffers; here every node of
    the forward and backward graphs allocates its output (freed after its last use, as the
    ``GraphModule``'s code ``del``-s it). The activations alive at the start of backward are
    exact; a peak inside forward or backward is an upper bound for inductor's.
  - Inside a compiled region there are no module boundaries: its ops are attributed to the
    compiled module (torch's ``OptimizedModule``).
  - The whole model is compiled as one ``torch.compile(model)`` (Dynamo splits it where it
    graph-breaks; each region is partitioned alone). Per-block compilation (torchtitan) gives
    one region per block and can save a different set at block boundaries.
  - Activation checkpointing (``ImplSpec.recompute``, applied by the tracer before compiling, as
    transformers' gradient checkpointing is under the HF Trainer's ``torch_compile``): Dynamo turns
    each checkpoint into a ``tag_activation_checkpoint`` region that the partitioner recomputes.
    A random op in it (SDPA's CPU kernel) replays the generator state saved in forward; the
    partition's rng higher-order ops run as plain ops (:func:`_plain_rng_ops`), a fake state on
    fake tensors. Per-block compilation (torchtitan, torchtune) is not what is traced.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

from trainmem.errors import UnsupportedError

__all__ = ["BACKEND_NAME", "SavedValue", "Compiled", "compile_model", "report"]

BACKEND_NAME = "trainmem_partition"


@dataclass(frozen=True)
class SavedValue:
    """One value a compiled region's forward hands to its backward (a node of the partitioned
    graph: a tensor, or a SymInt for dynamic shapes with ``shape=()`` and ``dtype="symint"``)."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    nbytes: int  # numel * itemsize of the value; views share their base's storage


@dataclass
class Compiled:
    """What :func:`compile_model` recorded: one tuple of saved values per partitioned region
    (a region that needs no gradient is not partitioned and not listed)."""

    regions: list[tuple[SavedValue, ...]] = field(default_factory=list)
    blocks: list = field(default_factory=list)  # per-block scope: (parent, name, block, compiled)
    scope: str = "model"
    loss: tuple | None = None  # block-loss scope: (model, its own loss_function override or None)


def _value(node) -> SavedValue:
    import torch

    val = node.meta.get("val")
    if isinstance(val, torch.Tensor):
        return SavedValue(node.name, tuple(int(d) for d in val.shape), str(val.dtype).removeprefix("torch."),
                          val.numel() * val.element_size())
    return SavedValue(node.name, (), "symint", 0)


def saved_values(backward_graph) -> tuple[SavedValue, ...]:
    """The backward graph's inputs other than its tangents: what the forward saved for it
    (``partitioners.py`` ``_extract_fwd_bwd_modules`` makes them the backward's placeholders,
    saved values and saved SymInts first, then ``tangents_*``)."""
    return tuple(_value(n) for n in backward_graph.graph.nodes
                 if n.op == "placeholder" and not n.name.startswith("tangents"))


def _save_rng_state(op, *args, **kwargs):
    """``run_and_save_rng_state`` as plain ops: the generator's state, then the op.

    ``torch.get_rng_state()`` is no dispatched op: a real step's live-storage meter never sees the
    state (host memory; on CUDA too, ``torch.cuda.get_rng_state()`` is a CPU tensor). On fake
    tensors it is converted to a fake one by the fake mode (no op either, so the tracer does not
    count it, as the meter does not), which the fake backward takes; ``saved_tensors_hooks`` see
    both."""
    import torch
    from torch._guards import detect_fake_mode

    state = torch.get_rng_state()
    mode = detect_fake_mode(args)
    if mode is not None:
        state = mode.from_tensor(state)
    return state, op(*args, **kwargs)


def _with_rng_state(state, op, *args, **kwargs):
    """``run_with_rng_state`` as plain ops: the op under the saved state (a fake state: the op
    alone, as the fake-tensor rule of ``torch/_prims/rng_prims.py`` does)."""
    import torch
    from torch._subclasses.fake_tensor import is_fake

    if is_fake(state):
        return op(*args, **kwargs)
    current = torch.get_rng_state()
    torch.set_rng_state(state)
    try:
        return op(*args, **kwargs)
    finally:
        torch.set_rng_state(current)


def _plain_rng_ops(gm) -> None:
    """Replace the partition's rng higher-order ops by :func:`_save_rng_state` and
    :func:`_with_rng_state`, so the ops they wrap dispatch through the tracer's modes like any other.

    A random op recomputed in a checkpointed region (SDPA's CPU kernel is tagged
    ``nondeterministic_seeded`` for its dropout) is wrapped by the partitioner in
    ``run_and_save_rng_state`` in forward and ``run_with_rng_state`` in backward
    (``torch/_functorch/partitioners.py`` ``functionalize_rng_ops``); the forward saves the
    generator's state for the backward. Higher-order ops refuse dispatch modes that do not register
    a rule for them, and their fake rule returns the real state (``torch/_prims/rng_prims.py``)."""
    from torch._prims.rng_prims import run_and_save_rng_state, run_with_rng_state

    swap = {run_and_save_rng_state: _save_rng_state, run_with_rng_state: _with_rng_state}
    changed = False
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target in swap:
            node.target = swap[node.target]
            changed = True
    if changed:
        gm.recompile()


def partitioning_backend(record: Compiled):
    """The ``trainmem_partition`` backend: inductor's decompositions and partition, no codegen."""
    from torch._dynamo.backends.common import aot_autograd
    from torch._dynamo.backends.debugging import boxed_nop
    from torch._guards import detect_fake_mode
    from torch._inductor.compile_fx import partition_fn
    from torch._inductor.decomposition import select_decomp_table
    from torch._inductor.virtualized import V

    def partition(joint, joint_inputs, **kwargs):
        # inductor's compile_fx runs aot_autograd under V.set_fake_mode; its joint-graph passes read it (a
        # dropout's seeds: fx_passes/replace_random.py fuse_seed_creation_pass), so the backend sets it too
        with V.set_fake_mode(detect_fake_mode(joint_inputs)):
            fw, bw = partition_fn(joint, joint_inputs, **kwargs)
        _plain_rng_ops(fw)
        _plain_rng_ops(bw)
        record.regions.append(saved_values(bw))
        return fw, bw

    return aot_autograd(fw_compiler=boxed_nop, bw_compiler=boxed_nop, partition_fn=partition,
                        decompositions=select_decomp_table(), keep_inference_input_mutations=True)


def compile_model(model, impl):
    """``(runs, record)``: the module the step calls and the record that fills as regions are
    partitioned. Shapes are static (``dynamic=False``: one compilation per step shape).

    ``impl.compile_scope == "model"``: ``runs = torch.compile(model)``, the wrapper, not
    ``model.compile()``: module hooks (the tracer's ModTracker) stand aside inside an
    ``OptimizedModule`` (``torch/distributed/_tools/mod_tracker.py`` ``_fw_pre_hook``), so they add
    nothing to the compiled graphs. ``"block"``: each decoder block is replaced in its parent by
    ``torch.compile(block)`` and ``runs = model``, the rest eager (:func:`_compile_blocks`)."""
    import torch

    torch._dynamo.reset()  # a fresh cache: a model built before must not count toward the recompile limit
    record = Compiled()
    backend = partitioning_backend(record)
    record.scope = scope = getattr(impl, "compile_scope", "model")
    if scope in ("block", "block-loss"):
        record.blocks = _compile_blocks(model, lambda block: torch.compile(block, backend=backend, dynamic=False))
        # transformers' blocks read their DynamicCache layer by index (cache_utils.py DynamicLayer.update:
        # `if not self.is_initialized`), a guard per block: one recompile each, and past Dynamo's recompile_limit
        # (8) the later blocks would run eager, which no per-block recipe does (torchtitan's and torchtune's
        # blocks have no cache: every block compiled)
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, len(record.blocks))
        if scope == "block-loss":  # torchtune's compile_loss: the loss function compiled alone
            # transformers' PreTrainedModel.loss_function (a property over _loss_function); under peft
            # the wrapped model's
            owner = next(m for m in model.modules() if isinstance(getattr(type(m), "loss_function", None), property))
            record.loss = (owner, owner.__dict__.get("_loss_function"))
            owner.loss_function = torch.compile(owner.loss_function, backend=backend, dynamic=False)
        return model, record
    return torch.compile(model, backend=backend, dynamic=False), record


def decoder_blocks(model) -> list[tuple[object, str, object]]:
    """``(parent, name, block)`` for each repeated block: transformers' ``GradientCheckpointingLayer``
    children of a ``ModuleList`` (``transformers/modeling_layers.py``: every decoder layer class)."""
    from torch import nn
    from transformers.modeling_layers import GradientCheckpointingLayer

    return [(parent, name, child) for parent in model.modules() if isinstance(parent, nn.ModuleList)
            for name, child in parent.named_children() if isinstance(child, GradientCheckpointingLayer)]


def _compile_blocks(model, compile_one) -> list[tuple[object, str, object, object]]:
    """Per-block compilation, as torchtitan's ``apply_compile``
    (``torchtitan/models/llama3/infra/parallelize.py``: each ``TransformerBlock`` of
    ``model.layers`` replaced by ``torch.compile(block, fullgraph=True)`` with ``register_module``,
    after activation checkpointing wrapped it, so a checkpoint runs inside the compiled region)
    and torchtune's ``compile_model`` (``torchtune/training/_compile.py``: ``m.compile()`` on each
    ``TransformerSelfAttentionLayer``). The embedding, final norm, head and loss run eager here
    (torchtitan's; torchtune also compiles its loss function alone: ``compile_loss``). Blocks of
    one class share one Dynamo cache entry: the record may hold fewer regions than blocks.
    Returns ``(parent, name, block, compiled)`` for :func:`_eager_blocks`."""
    swaps = []
    for parent, name, block in decoder_blocks(model):
        compiled = compile_one(block)
        parent.register_module(name, compiled)
        swaps.append((parent, name, block, compiled))
    if not swaps:
        raise UnsupportedError(f"compile_scope='block': {type(model).__name__} has no decoder blocks to compile")
    return swaps


def _reshard(model) -> None:
    """FSDP2 keeps the root's parameters unsharded after a forward no backward follows
    (``FSDPState._lazy_init`` clears the root's ``post_forward_mesh_info``): free them, as the step's own
    backward would, so the traced step starts from the shards alone (``FSDPModule.reshard``)."""
    from torch.distributed.fsdp import FSDPModule

    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.reshard()


@contextlib.contextmanager
def _eager_blocks(record: Compiled):
    """The per-block compiled model with its blocks eager again, for the eager saved set."""
    for parent, name, block, _ in record.blocks:
        parent.register_module(name, block)
    compiled_loss = None
    if record.loss is not None:  # the loss too (transformers' PreTrainedModel.loss_function reads _loss_function)
        model, own = record.loss
        compiled_loss = model.__dict__.pop("_loss_function")
        if own is not None:
            model._loss_function = own
    try:
        yield
    finally:
        for parent, name, _, compiled in record.blocks:
            parent.register_module(name, compiled)
        if record.loss is not None:
            record.loss[0]._loss_function = compiled_loss


def report(model, compiled_model, record: Compiled, forward) -> dict:
    """What the trace states about compilation, after the compiled step has run once: the
    backend, the partitioned regions and their saved values, and the bytes and count of the
    distinct storages autograd keeps for backward when ``forward(m)`` (a forward and its loss)
    runs with ``m = model`` (eager) and ``m = compiled_model``. The outputs are dropped."""
    from trainmem.trace.saved import saved_tensors

    if not record.regions:
        raise UnsupportedError("torch.compile partitioned no region (Dynamo ran the whole step eagerly); "
                               "nothing compiled to trace")
    with _eager_blocks(record) if record.blocks else contextlib.nullcontext():
        eager, out = saved_tensors(model, lambda: forward(model))
    del out
    compiled, out = saved_tensors(model, lambda: forward(compiled_model))
    del out
    _reshard(model)
    return {"backend": BACKEND_NAME, "scope": record.scope, "regions": len(record.regions),
            "saved_values": [len(r) for r in record.regions],
            "saved_eager_bytes": sum(t.nbytes for t in eager), "saved_eager_tensors": len(eager),
            "saved_compiled_bytes": sum(t.nbytes for t in compiled), "saved_compiled_tensors": len(compiled)}
