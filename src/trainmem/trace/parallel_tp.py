"""Tensor parallelism in the trace: the real DTensor code run in this one process, as rank 0 of N.

``trace --tp N [--sp]`` (``trace_step(..., parallel=ParallelSpec(tp=N, sp=...))``) starts torch's
fake process group as rank 0 of N (:func:`trainmem.trace.parallel_fsdp.fake_world`, the mesh made
outside ``FakeTensorMode``) and cuts the model with ``parallelize_module``
(``torch/distributed/tensor/parallel/api.py``) before the optimizer is made, so every DTensor
parameter, redistribute and collective output is made by torch itself, on fake tensors.

The blocks are cut as transformers' ``base_model_tp_plan`` says (``models/hf.py``
``tp_plan_of``), its ``colwise``/``rowwise`` styles as torch's ``ColwiseParallel``/``RowwiseParallel``
(transformers ``integrations/tensor_parallel.py`` ``ColwiseParallel``/``RowwiseParallel``: weights
``Shard(0)``/``Shard(-1)``, outputs ``Shard(-1)``/``Replicate``). The embedding and the output layer
follow trainmem's TP layout, as the estimate (``--profile hf``, ``estimate/parallel_tp.py``) and the
torchrun TP measurement (``measure_dist/worker.py`` ``_apply_tp``) do, both torchtitan's ``apply_tp``
(torchtitan/models/llama3/infra/parallelize.py): a vocab-parallel embedding
(``RowwiseParallel(input_layouts=Replicate())``), a column-parallel head whose logits stay
vocab-sharded (``Shard(-1)``, a DTensor) for ``loss_parallel()``'s cross-entropy, which wraps forward
and backward (torchtitan/distributed/utils.py ``get_train_context``).

``--sp`` (torchtitan's sequence parallelism): the embedding's output is ``Shard(1)``, each norm is
``SequenceParallel()``, each module holding column-cut linears gets ``PrepareModuleInput`` (its
``hidden_states`` all-gathered from ``Shard(1)`` to ``Replicate``), each row-cut linear's output is
reduce-scattered to ``Shard(1)`` and the head's input is ``Shard(1)``.

Known limitations:
  - the recorder's dispatch mode sees an op on DTensors once, at the DTensor level, not the local
    ops DTensor's sharding strategies run for it; loss_parallel's cross-entropy handlers, which
    compute on local shards with temporaries of their own, run with the recorder pushed back
    (trace/dtensor_handlers.py ``loss_handlers_seen``): the step equals a real gloo step's allocator
    peak to the byte (tests/parallel/test_tp_loss_parallel_exact.py);
  - the fake group completes each collective at once and leaves its output as it is: buffers
    the real backend keeps while a collective is in flight (gloo's, NCCL's) are not seen;
  - funcol's ``wait_tensor`` returns its input on a real group but a new tensor from its Meta kernel: the
    step's waits return their fake input (trace/dtensor_handlers.py ``waits_return_their_input``), else
    a collective's output would be held twice;
  - ``--optimizer-impl foreach`` without ``--sp`` is refused: the norms stay plain tensors and torch's
    foreach kernels refuse a mix of DTensor and plain parameters in one group;
  - plans with styles other than ``colwise``/``rowwise`` (packed, MoE, gather-output, local) and
    models without a ``base_model_tp_plan`` are refused in one line; TP with any other parallel
    dimension but FSDP2 (a 2-D mesh, :mod:`trainmem.trace.parallel_2d`) and pipeline stages (a (pp[, dp], tp)
    mesh, :mod:`trainmem.trace.parallel_pp`), Float8 and fine-tuning too,
    and fsdp-bf16 without FSDP2;
  - ``--compile`` runs as torchtitan applies it, each block compiled after the cut (``--compile-scope block``,
    :func:`trainmem.trace.compiled.compile_model`), with ``--sp``, at ``--recompute none`` (checkpointed, torch
    2.13 fails the step with a real process group too: estimate/compiled_tp.py ``CHECKPOINTED_TP_BLOCK_FAILS``),
    alone or with FSDP2 on the dp sub-mesh (:func:`_check_compiled`; tests/trace/test_trace_compile_tp.py,
    tests/trace/test_trace_compile_2d.py, docs/compile.md).
"""

from __future__ import annotations

import contextlib

from trainmem.errors import SpecError, UnsupportedError

__all__ = ["check_tp", "check_tp_flags", "apply_tp", "check_tp_model", "step_context", "strided_offsets_on_real_tensors", "tp_meta", "tp_line"]


def check_tp_flags(par) -> None:
    """Refuse, in one line, a layout the TP trace does not run: ``--tp N [--sp]`` alone."""
    if par.tp < 2:
        raise SpecError("tp", par.tp, "tensor parallelism needs --tp N, N >= 2 ranks")
    if par.fsdp is not None:  # TP + FSDP2 on a (dp_shard, tp) mesh (trace/parallel_2d.py), dp checked there
        from trainmem.trace.parallel_fsdp import check_fsdp_flags
        check_fsdp_flags(par)
    for flag, value, single in (("dp", par.dp if par.fsdp is None else 1, 1), ("cp", par.cp, 1), ("ep", par.ep, 1),
                                ("pp", par.pp, 1), ("zero", par.zero, 0)):
        if value != single:
            raise UnsupportedError(f"--{flag} {value} with --tp: trace runs tensor parallelism alone or with "
                                   f"--fsdp; estimate --tp {par.tp} --{flag} {value} gives the per-rank memory")
    if par.offload:
        raise UnsupportedError(f"--offload {','.join(par.offload)} with --tp: trace runs TP with every state "
                               "on the device; estimate gives the per-rank memory")


def check_tp(par, step, impl, finetune=None, config=None) -> None:
    """Refuse, in one line, what the TP trace does not run (``config``: what trace_step was given; a
    config.json dict is checked before the model is built)."""
    from collections.abc import Mapping

    from trainmem.specs import ModelSpec

    check_tp_flags(par)
    if isinstance(config, ModelSpec):
        raise UnsupportedError("--tp: trace cuts a transformers model by its base_model_tp_plan; trainmem's "
                               "reference model has none (use --profile hf, or estimate --tp)")
    if isinstance(config, Mapping):
        _check_sizes(config.get, par.tp, step.seq, par.sp)
    if impl.compile:  # compiled blocks after the cut: trace/compiled.py per block (estimate/compiled_tp.py)
        _check_compiled(par, impl)
    for what, given in (("--float8", impl.float8 != "none"),
                        ("--optimizer-in-backward", impl.optimizer_in_backward),
                        ("--finetune", finetune is not None),
                        ("--precision fsdp-bf16", step.dtypes.gathered and par.fsdp is None)):
        if given:
            raise UnsupportedError(f"{what} with --tp: not traced under tensor parallelism; estimate gives the "
                                   "per-rank memory")
    if impl.optimizer_impl == "foreach" and not par.sp and par.fsdp is None:  # under FSDP2 every parameter is a DTensor
        raise UnsupportedError("--optimizer-impl foreach with --tp and no --sp: torch's foreach kernels refuse a mix "
                               "of DTensor and plain parameters (the norms stay plain without --sp); use --sp, "
                               "for-loop or fused, or estimate")
    if step.loss != "ce":
        raise UnsupportedError(f"--loss {step.loss} with --tp: trace runs the model's own cross-entropy under "
                               "loss_parallel()")


def _check_compiled(par, impl) -> None:
    """``--compile`` under TP as torchtitan applies it (``apply_tp``, then ``apply_compile``): each block
    compiled after ``parallelize_module`` (then FSDP2, if asked), without checkpointing; refused in one line."""
    for field, value, ok, why in (
            ("compile_scope", impl.compile_scope, impl.compile_scope == "block",
             "TP blocks are compiled one by one (torchtitan's apply_compile): --compile-scope block"),
            # why, in full: estimate/compiled_tp.py CHECKPOINTED_TP_BLOCK_FAILS (importing it closes an import cycle)
            ("recompute", impl.recompute, impl.recompute == "none",
             "torch 2.13 fails a checkpointed compiled DTensor block with SDPA, on a real gloo group too "
             "(torch/_functorch/partitioners.py functionalize_rng_ops puts the recomputed SDPA's rng state after the "
             "saved DeviceMesh; AOTAutograd's save_from_forward then reads the mesh as a saved tensor)"),
            # FSDP2 on the dp sub-mesh after the compiled TP blocks: traced (tests/trace/test_trace_compile_2d.py);
            # (FSDP1 beside TP is refused by ParallelSpec itself)
            # checked on real tensors (trace_step(real=True)): with --sp the step runs and its peak equals the
            # fake trace's; without, the embedding's Redistribute.backward (torch/distributed/tensor/_redistribute.py)
            # gets a plain-tensor gradient from the compiled block 0 and fails (aot_eager too), though fake tensors run
            ("sp", par.sp, par.sp, "torch 2.13 fails a real compiled TP step without sequence parallelism (the "
             "embedding's redistribute gets a plain gradient back from the compiled block); use --sp, as torchtitan")):
        if not ok:
            raise UnsupportedError(f"--compile with --tp: {field}={value!r} is not traced: {why}")


def _styles(plan: dict[str, str]) -> None:
    bad = sorted({s for s in plan.values() if s not in ("colwise", "rowwise")})
    if bad:
        raise UnsupportedError(f"--tp: the model's base_model_tp_plan uses {', '.join(bad)}; trace runs colwise "
                               "and rowwise only")


def check_tp_model(model, tp: int, seq: int, sp: bool) -> dict[str, str]:
    """The model's plan (``tp_plan_of``), its heads and sequence checked against ``tp`` in one line."""
    from trainmem.models.hf import tp_plan_of

    if not hasattr(getattr(model, "config", None), "model_type"):
        raise UnsupportedError(f"--tp: trace cuts a transformers model by its base_model_tp_plan; "
                               f"{type(model).__name__} has none (use --profile hf, or estimate --tp)")
    plan = tp_plan_of(model)
    if not plan:
        raise UnsupportedError(f"--tp: model_type={model.config.model_type!r} has no base_model_tp_plan in "
                               "transformers; its tensor-parallel cut is unknown")
    _styles(plan)
    _check_sizes(lambda field: getattr(model.config, field, None), tp, seq, sp)
    return plan


def _check_sizes(get, tp: int, seq: int, sp: bool) -> None:
    for field in ("num_attention_heads", "num_key_value_heads", "intermediate_size"):
        value = get(field)
        if value and value % tp:
            raise SpecError("tp", tp, f"must divide {field} ({value})")
    if sp and seq % tp:
        raise SpecError("tp", tp, f"--sp needs tp to divide the sequence length ({seq})")


def _block_plan(plan: dict[str, str], block: str, sp: bool, names: list[str]) -> dict:
    """One block's ``parallelize_module`` plan, relative to the block (``self_attn.q_proj`` ...)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel, PrepareModuleInput, RowwiseParallel, SequenceParallel,
    )

    out: dict = {}
    for name in names:
        pattern = block.rpartition(".")[0] + ".*." + name
        style = plan.get(pattern)
        if style == "colwise":
            out[name] = ColwiseParallel()
            parent = name.rpartition(".")[0]
            if sp and parent and parent not in out:  # its input gathered along S once, for all its linears
                # as the decoder layers call them (and measure_dist/worker.py _apply_tp): attention by
                # keyword (hidden_states=...), the MLP positionally
                out[parent] = (PrepareModuleInput(input_kwarg_layouts={"hidden_states": Shard(1)},
                                                  desired_input_kwarg_layouts={"hidden_states": Replicate()})
                               if "attn" in parent.rpartition(".")[2] else
                               PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)))
        elif style == "rowwise":
            out[name] = (RowwiseParallel(output_layouts=Shard(1), use_local_output=False) if sp
                         else RowwiseParallel())
    if sp:
        for name in names:
            if "." not in name and name.endswith("norm"):
                out[name] = SequenceParallel()
    return out


def apply_tp(model, mesh, par, seq: int):
    """``parallelize_module`` the model over ``mesh`` (see the module docstring); returns the model."""
    import torch
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel, RowwiseParallel, SequenceParallel, parallelize_module,
    )

    from trainmem.trace.parallel_fsdp import _blocks

    plan = check_tp_model(model, par.tp, seq, par.sp)
    modules = dict(model.named_modules())
    name_of = {id(m): n for n, m in modules.items()}
    embed, head = model.get_input_embeddings(), model.get_output_embeddings()
    if embed is None or head is None or head.weight is embed.weight:
        raise UnsupportedError("--tp: trace cuts the embedding and the output layer apart (vocab-parallel); "
                               "a model with tied or missing ones is not traced")
    top: dict = {}
    # loss_parallel's vocab-sharded logits, or (--no-loss-parallel) all-gathered to a plain tensor
    head_kw = (dict(output_layouts=Shard(-1), use_local_output=False) if par.loss_parallel
               else dict(output_layouts=Replicate(), use_local_output=True))
    if par.sp:
        top[name_of[id(embed)]] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1),
                                                  use_local_output=False)
        top[name_of[id(head)]] = ColwiseParallel(input_layouts=Shard(1), **head_kw)
        norm = getattr(getattr(model, getattr(model, "base_model_prefix", ""), model), "norm", None)
        if isinstance(norm, torch.nn.Module):
            top[name_of[id(norm)]] = SequenceParallel()
    else:
        top[name_of[id(embed)]] = RowwiseParallel(input_layouts=Replicate())
        top[name_of[id(head)]] = ColwiseParallel(**head_kw)
    parallelize_module(model, mesh, top)
    for block in _blocks(model):
        bname = name_of[id(block)]
        names = [n for n, _ in block.named_modules() if n]
        parallelize_module(block, mesh, _block_plan(plan, bname, par.sp, names))
    return model


def step_context(par):
    """What one TP forward and backward runs under (``par`` a ParallelSpec or None): ``loss_parallel()``
    with vocab-sharded logits (its handlers seen by the recorder), waits that return their input
    (trace/dtensor_handlers.py), and :func:`strided_offsets_on_real_tensors`."""
    import contextlib

    stack = contextlib.ExitStack()
    if par is not None:
        from trainmem.trace.dtensor_handlers import waits_return_their_input
        stack.enter_context(strided_offsets_on_real_tensors())
        stack.enter_context(waits_return_their_input())
        if par.loss_parallel:
            from torch.distributed.tensor.parallel import loss_parallel
            from trainmem.trace.dtensor_handlers import loss_handlers_seen
            stack.enter_context(loss_parallel())
            stack.enter_context(loss_handlers_seen())
    return stack


@contextlib.contextmanager
def strided_offsets_on_real_tensors():
    """``_StridedShard.local_shard_size_and_offset`` (torch/distributed/tensor/placement_types.py),
    reached when a sequence-parallel DTensor is reshaped and then all-gathered, finds a rank's rows by
    splitting a fresh ``arange`` of the dimension and reading it back (``tolist``), which a fake
    tensor cannot answer; the arange is index arithmetic, no model data, so it runs on real CPU
    tensors (``unset_fake_temporarily``) and the DTensor code goes on unchanged."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    from torch.distributed.tensor.placement_types import _StridedShard

    original = _StridedShard.local_shard_size_and_offset

    def on_real(self, *args, **kwargs):
        with unset_fake_temporarily():
            return original(self, *args, **kwargs)

    _StridedShard.local_shard_size_and_offset = on_real
    try:
        yield
    finally:
        _StridedShard.local_shard_size_and_offset = original


def tp_meta(par) -> dict:
    """What the result states about the cut it ran."""
    return {"world_size": par.tp, "rank": 0, "sp": par.sp, "loss_parallel": par.loss_parallel,
            "process_group": "fake"}


def tp_line(meta: dict) -> str:
    """What a TP trace ran, in one line."""
    sp = " with sequence parallelism" if meta["sp"] else ""
    head = "loss_parallel head" if meta["loss_parallel"] else "head's logits all-gathered"
    return (f"TP: rank 0 of {meta['world_size']} (torch's fake process group), DTensor parallelize_module of "
            f"transformers' base_model_tp_plan{sp}; vocab-parallel embedding, {head}")
