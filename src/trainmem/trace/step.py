"""``trace_step``: build a model, run two training steps, trace the second.

The step is ``loss = model(ids, labels=ids).loss; loss.backward(); optimizer.step();
optimizer.zero_grad(set_to_none=True)``, with the optimizer in ``impl.optimizer_impl`` (:mod:`trainmem.trace.optimizers`) (auto:
torch's default on ``impl.device``, foreach for cuda, so the trace shows what a CUDA device would
hold), or stepped per parameter inside backward with ``impl.optimizer_in_backward``. The first
step creates the optimizer state; the second is recorded with everything alive at its start as
the baseline.

Precision recipes (``StepSpec.precision``):
  - ``fp32``: fp32 model.
  - ``bf16``/``fp16``: the model is cast (``model.to``); gradients and optimizer state in 16 bits.
  - ``amp-bf16``/``amp-fp16``: fp32 model, forward and loss under ``torch.autocast('cpu')``.
    No GradScaler for fp16 (its few scalars do not change the peak).
  - ``mixed-bf16``/``mixed-fp16``: 16-bit model and gradients; the optimizer owns fp32 master
    copies. After backward each 16-bit gradient is cast into its master's ``.grad`` and freed,
    the optimizer steps the masters, and the masters are copied back into the model.

Recompute (``ImplSpec.recompute``, :mod:`trainmem.trace.recompute`): ``full`` and ``every-k`` use Hugging Face gradient
checkpointing (non-reentrant ``torch.utils.checkpoint``) on every / every k-th decoder layer;
``selective`` checkpoints the attention core (the ``attention_interface`` call: scores, softmax,
dropout and the weighted sum), not the projections; ``op`` checkpoints every decoder layer with
``create_selective_checkpoint_contexts`` and torchtitan's op policy (:func:`op_sac_context`).

Heads (``head``, :data:`trainmem.models.hf.HEADS`): ``lm`` and ``mlm`` take ``labels=ids``;
``seq-cls`` takes one class label per sequence, ``token-cls`` one per token; ``seq2seq`` (T5-style) takes ``labels=ids``, which
the model shifts into a decoder input as long as the encoder's.

MoE (see :mod:`trainmem.trace.routing`): the router's expert ids are replaced by the fixed
assignment ``impl.routing`` names, on fake and real tensors alike, so the expert-token counts are
concrete. Experts run ``experts`` (transformers' ``experts_implementation``: ``grouped_mm`` by
default, ``eager`` for the per-expert loop, whose memory depends on the routing). grouped_mm
experts whose weights are not bf16 run transformers' own fallback op
(``transformers::grouped_mm_fallback``, ``transformers/integrations/moe.py``) in both modes:
torch 2.13's meta kernel for ``aten._grouped_mm`` accepts bf16 only; the fallback saves the same
tensors and returns the same shapes.

Known limitations:
  - ``mem-efficient`` attention has no CPU implementation; ``chunked-ce`` and ``fused-ce`` are not Hugging Face
    options (torchtune's and LitGPT's chunked losses are: :mod:`trainmem.trace.losses`): all raise
    UnsupportedError. bitsandbytes' optimizers are traced on CPU, where paging
    falls back to plain tensors.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Mapping

from trainmem.errors import UnsupportedError
from trainmem.specs import ImplSpec, StepSpec
from trainmem.trace.optimizers import make_optimizer_for
from trainmem.trace.recompute import enable_recompute, selective_recompute
from trainmem.trace.result import TraceResult
from trainmem.trace.torch_state import default_dtype, quiet_fake_tensor_log, torch_dtype

__all__ = ["trace_step"]


def _check(step: StepSpec, impl: ImplSpec, *, fsdp2: bool = False) -> None:
    if step.mode != "train":
        raise UnsupportedError(f"mode={step.mode!r}: the tracer runs training steps only")
    from trainmem.trace.losses import FRAMEWORK_LOSSES  # torchtune's and LitGPT's chunked losses (trace/losses.py)
    if step.loss != "ce" and step.loss not in FRAMEWORK_LOSSES:
        raise UnsupportedError(f"loss={step.loss!r} is not traced: the tracer runs the model's own cross-entropy "
                               f"(ce) or a framework's chunked loss ({', '.join(FRAMEWORK_LOSSES)})")
    if step.loss != "ce" and impl.compile and (step.loss, impl.compile_scope) not in (
            ("torchtune-chunked-ce", "block-loss"), ("torchtune-chunked-ce", "block")):
        raise UnsupportedError(f"loss={step.loss!r} with compile_scope={impl.compile_scope!r} is not traced: "
                               "torchtune's chunked loss is traced with block or block-loss (its compile_loss)")
    if impl.attention == "mem-efficient":
        raise UnsupportedError("attention='mem-efficient' has no CPU kernel; trace 'flash' or 'sdpa-math' instead")
    from trainmem.specs.optimizer_impl import check_optimizer
    check_optimizer(step, impl)
    if step.dtypes.gathered and not fsdp2:  # its bf16 weights are FSDP2's all-gather outputs
        raise UnsupportedError(f"precision={step.precision!r} needs FSDP2; trace and profile run one device "
                               "without it: use amp-bf16 (what torchtitan runs without FSDP)")
    if step.dtypes.master and step.dtypes.grad != step.dtypes.param:  # Megatron's fp32 main_grad buffer
        raise UnsupportedError(f"precision={step.precision!r} keeps fp32 main gradients in Megatron's grad buffer; "
                               "the tracer steps torch's .grad: trace mixed-bf16 (2 bytes per parameter fewer)")


def _attention_context(impl: ImplSpec):
    if impl.attention == "sdpa-math":
        from torch.nn.attention import SDPBackend, sdpa_kernel
        return sdpa_kernel([SDPBackend.MATH])
    if impl.attention == "flash":
        from torch.nn.attention import SDPBackend, sdpa_kernel
        return sdpa_kernel([SDPBackend.FLASH_ATTENTION])
    return contextlib.nullcontext()


@contextlib.contextmanager
def _grouped_mm_fallback_unless_bf16():
    """Send non-bf16 grouped_mm experts to transformers' fallback op (see the module docstring)."""
    from transformers.integrations import moe

    original = moe._can_use_grouped_mm

    def can_use(input, weight, offs):
        return weight.dtype == torch_dtype("bfloat16") and original(input, weight, offs)

    moe._can_use_grouped_mm = can_use
    try:
        yield
    finally:
        moe._can_use_grouped_mm = original


def _check_positions(model, seq: int) -> None:
    """Fake tensors hold no indices, so a sequence past a learned position table would not fail."""
    import torch
    from trainmem.errors import SpecError
    for name, m in model.named_modules():
        if isinstance(m, torch.nn.Embedding) and "position" in name and m.num_embeddings < seq:
            raise SpecError("seq", seq, f"exceeds the model's learned positions ({name} has {m.num_embeddings} rows)")


def _head_of(model) -> str:
    from trainmem.models.hf import HEADS
    name = type(model).__name__
    return next((h for h, (_, suffix) in HEADS.items() if name.endswith(suffix)), "lm")


def _inputs(model, step: StepSpec, head: str) -> dict:
    """The keyword arguments of one forward: token ids and the labels the head's loss needs."""
    import torch
    ids = torch.randint(0, model.config.vocab_size, (step.batch, step.seq))
    if head == "seq-cls":
        return {"input_ids": ids, "labels": torch.randint(0, model.config.num_labels, (step.batch,))}
    if head == "token-cls":
        return {"input_ids": ids, "labels": torch.randint(0, model.config.num_labels, (step.batch, step.seq))}
    return {"input_ids": ids, "labels": ids}


def trace_step(model_or_config, step: StepSpec | None = None, impl: ImplSpec | None = None, *,
               real: bool = False, progress: Callable[[float, str], None] | None = None,
               head: str | None = None, experts: str | None = None, finetune=None,
               offload: tuple[str, ...] = (), parallel=None, pp_rank: int = 0) -> TraceResult:
    """Trace one training step of a Hugging Face model.

    ``model_or_config`` is a ``config.json`` dict (a Hugging Face model with random weights, any
    type transformers builds, with ``head``: see the module docstring), a
    :class:`~trainmem.specs.ModelSpec` (trainmem's reference model, whose recompute and kernels
    follow ``impl``), or an already built ``nn.Module`` with ``config.vocab_size`` called as
    ``model(input_ids=ids, labels=ids).loss``. Models are built on fake tensors unless ``real``.
    ``experts`` is transformers' ``experts_implementation`` for MoE models.
    ``progress`` is called with (fraction done, phase) as modules run.
    ``offload=("activations",)``: torchtune's activation offloading (:mod:`trainmem.trace.offload`);
    the host copies are not device memory and ``meta["offload"]`` reports them.
    ``finetune`` (a :class:`~trainmem.specs.finetune.FinetuneSpec`) freezes parameters or adds
    peft LoRA adapters to a config's model (:mod:`trainmem.trace.finetune`).
    ``parallel`` (a :class:`~trainmem.specs.ParallelSpec`): FSDP2 over ``dp`` ranks, run as rank 0 in
    torch's fake process group (:mod:`trainmem.trace.parallel_fsdp`), or DTensor tensor parallelism over
    ``tp`` ranks, the same way (:mod:`trainmem.trace.parallel_tp`), or both, and HSDP, on a 2-D mesh
    (:mod:`trainmem.trace.parallel_2d`), or pipeline rank ``pp_rank`` of
    ``pp`` under torch.distributed.pipelining's schedule (:mod:`trainmem.trace.parallel_pp`); other
    parallelism is refused.
    """
    step = step or StepSpec()
    impl = impl or ImplSpec()
    if parallel is not None and parallel.is_single and parallel.pp == 1:
        parallel = None
    pp = None
    if parallel is not None and parallel.pp > 1:  # alone, with FSDP2 per stage, or with TP inside each stage
        from trainmem.trace.parallel_pp import check_pp  # one pipeline rank (trace/parallel_pp.py)
        check_pp(parallel, step, impl, finetune, config=model_or_config, rank=pp_rank)
        pp, parallel = (parallel, pp_rank), None
    tp = parallel is not None and parallel.tp > 1  # tensor parallelism (trace/parallel_tp.py)
    fsdp = parallel is not None and (parallel.fsdp is not None or not tp)  # with TP: a 2-D mesh (trace/parallel_2d.py)
    if tp:
        from trainmem.trace.parallel_tp import check_tp
        check_tp(parallel, step, impl, finetune, config=model_or_config)
    if fsdp:
        from trainmem.trace.parallel_fsdp import check_fsdp
        check_fsdp(parallel, step, impl, finetune)
    _check(step, impl, fsdp2=fsdp)
    from trainmem.trace.finetune import check_finetune
    check_finetune(finetune, recompute=impl.recompute)
    if finetune is not None and not isinstance(model_or_config, Mapping):
        raise UnsupportedError("fine-tuning is traced on a config's Hugging Face model; apply peft to your own "
                               "model before trace_step, or use --profile hf")
    try:
        import torch
        from torch._subclasses.fake_tensor import FakeTensorMode
    except ImportError:  # pragma: no cover
        raise UnsupportedError("tracing needs torch: pip install 'trainmem[torch]'") from None
    from torch._subclasses import fake_tensor as ft
    from trainmem.trace.hf_masks import masks_as_on_real_tensors

    dt = step.dtypes
    fake = not real
    mode = FakeTensorMode() if fake else contextlib.nullcontext()
    world = contextlib.nullcontext((None, None))
    if parallel is not None:  # the process group and meshes are made outside FakeTensorMode
        from trainmem.trace.parallel_2d import parallel_world
        world = parallel_world(parallel)
    if pp is not None:  # the fake process group, made outside FakeTensorMode
        from trainmem.trace.parallel_pp import pp_world
        world = pp_world(*pp)
    try:
        with world as (fsdp_mesh, tp_mesh), quiet_fake_tensor_log(), mode, _attention_context(impl), \
                masks_as_on_real_tensors():
            return _run(model_or_config, step, impl, dt, progress, head=head, experts=experts, finetune=finetune, pp=pp,
                        offload=offload, fsdp=(parallel, fsdp_mesh) if fsdp else None,
                        tp=(parallel, tp_mesh) if tp else (pp[0], tp_mesh) if tp_mesh is not None else None)
    except (ft.DynamicOutputShapeException, ft.DataDependentOutputException) as exc:
        raise UnsupportedError(f"op {exc.func} has a data-dependent output and cannot run on fake tensors; "
                               "trace with real=True (--real) on a small config") from None
    except ft.UnsupportedOperatorException as exc:
        raise UnsupportedError(f"op {exc.func} has no fake-tensor implementation; trace with real=True (--real)") from None
    except NotImplementedError as exc:
        raise UnsupportedError(f"an op is not implemented here: {str(exc).splitlines()[0]}") from None
    except (RuntimeError, IndexError) as exc:  # the model itself refused this step (a shape it cannot take)
        first = str(exc).strip().splitlines()[0][:300] if str(exc).strip() else type(exc).__name__
        raise UnsupportedError(f"the model cannot run B={step.batch}, S={step.seq}: {first}") from None


def _routing(model, impl: ImplSpec, *, fake: bool):
    """The routing context for ``model`` (nothing for a dense model) and what the result states."""
    from trainmem.specs.impl import routing_hot_fraction
    from trainmem.trace.routing import ConcreteInts, experts_modules, force_routing

    modules = experts_modules(model)
    if not modules:
        return contextlib.nullcontext(), None
    stack = contextlib.ExitStack()
    stack.enter_context(force_routing(model, routing_hot_fraction(impl.routing)))
    stack.enter_context(_grouped_mm_fallback_unless_bf16())
    first = modules[0]
    implementation = first.config._experts_implementation
    if fake and implementation == "eager":  # the per-expert loop reads expert ids; the others only shapes
        stack.enter_context(ConcreteInts())
    top_k = getattr(model.config, "num_experts_per_tok", None) or getattr(model.config, "moe_topk", None)
    meta = {"routing": impl.routing, "experts_implementation": implementation,
            "num_experts": first.num_experts, "top_k": top_k, "experts_modules": len(modules)}
    return stack, meta


def _model_spec_or_none(config: Mapping):
    """The ModelSpec trainmem reads from ``config`` (for the freeze patterns), or None for a type it does not map."""
    from trainmem.specs.loaders import SUPPORTED_MODEL_TYPES, spec_from_hf_config
    return spec_from_hf_config(dict(config)) if config.get("model_type") in SUPPORTED_MODEL_TYPES else None


def _run(model_or_config, step: StepSpec, impl: ImplSpec, dt, progress, *, head=None, experts=None,
         finetune=None, offload: tuple[str, ...] = (), fsdp=None, tp=None, pp=None) -> TraceResult:
    import torch
    from torch._subclasses.fake_tensor import is_fake
    from trainmem.trace.api import Tracer

    from trainmem.specs import ModelSpec

    reference = isinstance(model_or_config, ModelSpec)
    if reference:
        from trainmem.models.reference import build_reference_model
        with default_dtype(torch_dtype(dt.param)):  # model.to() cannot swap fake parameters
            model = build_reference_model(model_or_config, impl)
        vocab = model_or_config.vocab_size
    elif isinstance(model_or_config, Mapping):
        from trainmem.models.hf import build_hf_model
        with default_dtype(torch_dtype(dt.param)):
            model = build_hf_model(model_or_config, attention=impl.attention, head=head, experts=experts,
                                   init_weights=not is_fake(torch.empty(0)))
    else:
        model = model_or_config
        vocab = getattr(getattr(model, "config", None), "vocab_size", None)
        if not vocab:
            raise UnsupportedError(f"{type(model).__name__} has no config.vocab_size; use trace() for custom models")
    model.train()
    head = "lm" if reference else _head_of(model)
    if not reference:
        _check_positions(model, step.seq)
    if not reference:  # the reference model checkpoints by itself, from impl
        enable_recompute(model, impl, parallel=pp[0] if pp is not None else None)  # every-k: per pipeline rank
    float8_names = None
    if impl.float8 != "none":  # trace/float8.py: torchao's own conversion, filtered as torchtitan does
        from trainmem.trace.float8 import convert_float8
        float8_names = convert_float8(model, impl, fsdp=fsdp is not None)
    built = type(model).__name__
    if finetune is not None:  # after checkpointing is enabled, as peft's recipes do
        from trainmem.trace.finetune import apply_finetune
        model_spec = _model_spec_or_none(model_or_config)
        finetune = finetune.for_model(model_spec)  # LoRA targets: the family's default
        model = apply_finetune(model, finetune, model_spec)
    if tp is not None:  # parallelize_module before the optimizer sees the parameters (trace/parallel_tp.py)
        from trainmem.trace.parallel_tp import apply_tp
        model = apply_tp(model, tp[1], tp[0], step.seq)
    if fsdp is not None:  # fully_shard after TP (torchtitan's order), before the optimizer (trace/parallel_fsdp.py)
        from trainmem.trace.parallel_fsdp import apply_fsdp
        model, fsdp_units = apply_fsdp(model, fsdp[1], fsdp[0], step)
    pipe = None
    if pp is not None:  # this rank's stages, before the optimizer sees their parameters (trace/parallel_pp.py)
        from trainmem.trace.parallel_pp import apply_pp
        model, pipe = apply_pp(model, *pp, step)
    from trainmem.trace.parallel_tp import step_context

    params, masters, optimizer = make_optimizer_for(model, step, impl)
    autocast = (torch.autocast("cpu", dtype=torch_dtype(dt.activation)) if dt.autocast
                else contextlib.nullcontext())
    if dt.autocast and float8_names is not None:  # Float8Linear reads CUDA's autocast state
        from trainmem.trace.float8 import Float8Autocast
        autocast = Float8Autocast(autocast, torch_dtype(dt.activation))
    selective = (selective_recompute(model, impl.attention) if impl.recompute == "selective" and not reference
                 else contextlib.nullcontext())
    if reference:
        ids = torch.randint(0, vocab, (step.batch, step.seq))
        inputs = {"input_ids": ids, "labels": ids}
    else:
        inputs = _inputs(model, step, head)
    ids = inputs["input_ids"]
    if pipe is not None:  # the whole batch's ids on the first stage, the targets on the last
        inputs = pipe.inputs
    routing, moe_meta = _routing(model, impl, fake=is_fake(ids)) if not reference else (
        contextlib.nullcontext(), None)

    from trainmem.trace.losses import FRAMEWORK_LOSSES, HeldLogits, chunk_cross_entropy, framework_loss
    held = HeldLogits()  # LitGPT's loop keeps its logits through backward and the optimizer step
    chunk_ce = chunk_cross_entropy
    if impl.compile and impl.compile_scope == "block-loss":  # torchtune's compile_loss: each chunk's CE
        from trainmem.trace.compiled import Compiled, partitioning_backend
        chunk_ce = torch.compile(chunk_cross_entropy, backend=partitioning_backend(Compiled()), dynamic=False)
    # torchtune's recipe makes its ignore_labels_cache (B, 1) once, at setup
    ignore = torch.full((step.batch, 1), -100, dtype=ids.dtype) if step.loss != "ce" else None

    def loss_of(m):
        with autocast:
            if step.loss in FRAMEWORK_LOSSES:
                if reference:
                    raise UnsupportedError(f"loss={step.loss!r} is traced on Hugging Face models")
                return framework_loss(step.loss, m, ids, ignore_labels=ignore, held=held, chunk_ce=chunk_ce)
            return m(ids, **{k: v for k, v in inputs.items() if k != "input_ids"}).loss

    def one_step() -> None:
        for _ in range(step.grad_accum):
            if pipe is not None:  # the schedule runs every micro-batch's forward, loss and backward
                with autocast, step_context(tp[0] if tp is not None else None):  # as torchtitan's train step
                    pipe.step()
                continue
            with step_context(tp[0] if tp is not None else None):  # TP: loss_parallel() over forward and backward
                loss = loss_of(runs)
                (loss / step.grad_accum if step.grad_accum > 1 else loss).backward()
            del loss
        if masters is not None:
            for m, p in zip(masters, params):
                m.grad = p.grad.to(m.dtype)
                p.grad = None
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        held.clear()
        if masters is not None:
            with torch.no_grad():
                for m, p in zip(masters, params):
                    p.copy_(m)

    from trainmem.specs.optimizer_impl import optimizer_impl_used
    used = {"optimizer_impl": optimizer_impl_used(step, impl)}  # the implementation auto resolved to
    meta = {"step": step.to_dict(), "impl": {**impl.to_dict(), **used}, "fake": bool(is_fake(ids)),
            "model": built,
            "head": head, "torch": torch.__version__}
    if moe_meta:
        meta["moe"] = moe_meta
    if float8_names is not None:
        meta["float8"] = {"recipe": impl.float8, "converted": float8_names}
    if finetune is not None:
        meta["finetune"] = finetune.to_dict()
    if fsdp is not None:
        from trainmem.trace.parallel_fsdp import fsdp_meta
        meta["fsdp"] = fsdp_meta(fsdp[0], fsdp_units)
    if tp is not None:
        from trainmem.trace.parallel_tp import tp_meta
        meta["tp"] = tp_meta(tp[0])
    from trainmem.trace.parallel_2d import is_2d, mesh_meta
    if fsdp is not None and is_2d(fsdp[0]):  # HSDP, TP + FSDP2 (trace/parallel_2d.py)
        meta["mesh"] = mesh_meta(fsdp[0])
    if pp is not None:
        from trainmem.trace.parallel_pp import pp_meta
        meta["pp"] = pp_meta(*pp)
    runs = model
    if impl.compile:  # trace/compiled.py: torch.compile, partitioned as inductor does, no codegen
        from trainmem.trace.compiled import compile_model, report
        runs, compiled = compile_model(model, impl)
    from trainmem.trace.offload import offload_activations
    offloading = offload_activations(model) if "activations" in offload else contextlib.nullcontext()
    with selective, routing, offloading as off:
        one_step()
        if impl.compile:  # TP: the report's forwards under loss_parallel too (trace/parallel_tp.py)
            with step_context(tp[0] if tp is not None else None):
                meta["compile"] = report(model, runs, compiled, pipe.microbatch_forward if pipe is not None else loss_of)
        distinct = list({id(t): t for t in inputs.values()}.values())  # labels are often the ids
        if ignore is not None:
            distinct.append(ignore)
        tracer = Tracer(model, optimizer, inputs=distinct, meta=meta, progress=progress)
        if pipe is not None:  # the stages' receive buffers; under FSDP2 the storages it resizes
            pipe.register(tracer, model)
        if fsdp is not None:
            from trainmem.trace.parallel_fsdp import unsharded_storages
            tracer.watch_resizable(*unsharded_storages(model))
        with tracer:
            if off is not None:
                off.reset()
            one_step()
            if off is not None:
                meta["offload"] = off.report()
    return tracer.result
