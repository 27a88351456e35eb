"""Pipeline parallelism in the trace: torch.distributed.pipelining's real schedule for one rank.

``trace --pp N [--schedule gpipe|1f1b|interleaved] [--virtual-stages V] --microbatches M
[--pp-rank R]`` (``trace_step(..., parallel=ParallelSpec(pp=N, ...), pp_rank=R)``) starts torch's
fake process group with this process as rank ``R`` of ``N`` (``FakeProcessGroup`` completes every
send and receive at once and leaves the receive buffer as it is: the received tensors are fake
anyway), cuts the model into this rank's stages and runs the schedule's ``step`` on fake tensors,
so every stage input, stage output, receive buffer, activation and gradient is made by torch's
pipelining code itself.

The cut is the estimate's (``estimate/parallel_pp.py`` ``stage_layers``, ``_stage_of``): stage ``s``
owns its layers (``--layer-split`` or an even split, the first stages taking the remainder), the
first stage the token embedding, the last the final norm and output layer, every stage its own
rotary tables; under ``interleaved`` rank ``r`` runs global stages ``r + j·N`` (torchtitan's
``stage_ids_this_rank``, style "loop") of ``L / (N·V)`` layers each. A stage is built as torchtitan's
``pipeline_module_split`` builds it (torchtitan/distributed/pipeline_parallel.py): the whole model,
then the layers it does not own deleted by key (so ``model.layers.2`` keeps its name) and the
embedding, norm and output layer it does not own removed; its forward is the Hugging Face base
model's own forward (``inputs_embeds`` after the first stage) and then the output layer on the
last. The loss runs in the schedule's ``loss_fn`` as ``model.loss_function`` (Hugging Face's
cross-entropy: shifted labels, logits upcast), as ``measure_dist/worker.py`` runs it on gloo.

Each ``PipelineStage`` is given its input and output shapes (static metadata): torch's warm-up
vote (``PipelineScheduleSingle._warmup_p2p``, schedules.py) sends each rank's vote through the
process group, which the fake group cannot carry, so the schedule is told the outcome every rank
would reach with static shapes on every stage, ``InferenceMode.STATIC``; the dynamic inference of
a real run computes the same shapes (the boundary is the residual stream, B × S × H in the
parameters' dtype). The receive buffers ``PipelineStage`` allocates once per micro-batch and keeps
across steps (``_PipelineStage._setup_forward_recv_info`` / ``_create_grad_recv_info``, stage.py) are
registered as buffers of the traced step.

``--dp N --fsdp full`` with ``--pp`` shards every stage with FSDP2 over its data-parallel ranks, as
torchtitan's ``apply_fsdp`` under PP and the torchrun worker (``pp_dp``) do: the ranks form a (pp, dp)
fake mesh, this process is data-parallel rank 0 of its stage, each block and then the stage are
``fully_shard``-ed and the pipeline's P2P runs on the mesh's ``pp`` group. The schedule turns gradient
sync off until a stage's last micro-batch (``_PipelineStageBase.backward_maybe_with_nosync``,
``perform_reduce_grad``), so autograd's unsharded gradients live across the micro-batches and each unit
reduce-scatters once per step; the recorder follows FSDP's resized storages as under ``--fsdp`` alone.

``--tp N [--sp]`` with ``--pp`` (and ``--dp D --fsdp full``: torchtitan's 3-D layout) cuts every block with
:func:`trainmem.trace.parallel_tp.apply_tp` on the ``tp`` slice of a (pp[, dp], tp) fake mesh, this process
being its rank (R, 0[, 0]), before the stage cut (torchtitan cuts the stages first and runs ``apply_tp`` per stage
model; the modules, and so what each holds, are the same), then FSDP2 on the ``dp`` slice; the pipeline's P2P
runs on the ``pp`` group. Under SP the residual stream crosses stages as it does in torchtitan, the rank's local
S/tp tokens (torchtitan's ``RowwiseParallel(output_layouts=Shard(1))`` keeps ``use_local_output``): a stage
sends its output's local tensor and wraps what it receives as a ``Shard(1)`` DTensor (``DTensor.from_local``,
no copy), so the receive buffers are B × S/tp × H; the last stage's logits stay vocab-sharded for
``loss_parallel()``, which wraps the schedule's step.

``--compile --compile-scope block`` compiles each block of the rank's stage (``trace/compiled.py``
``compile_model`` on the stage module, after the cut and any ``fully_shard``), as torchtitan does:
``pipeline_llama`` cuts the model, then ``parallelize_fn`` runs ``apply_compile`` on every stage model
(torchtitan/models/llama3/infra/parallelize.py). The schedule calls the stage module, so each block is its
own region with the one-device block's inputs; the saved sets the result reports are one micro-batch's
through the stage (:meth:`Pipeline.microbatch_forward`).

Known limitations:
  - Llama-like decoders only (``model.embed_tokens``, ``model.layers``, ``model.norm`` and
    ``lm_head``, the HF base model taking ``inputs_embeds``); the ``lm`` head, cross-entropy loss,
    no fine-tuning, Float8, optimizer-in-backward or offload; compile per block under gpipe and 1f1b
    only (an interleaved rank's virtual stages keep their own copies of the block table), under TP as
    trace/parallel_tp.py allows it (--sp, --recompute none); ``--grad-accum`` 1 (the
    micro-batches are the accumulation); zero-bubble schedules are not run; FSDP2 under PP with
    gpipe/1f1b, full sharding per block, fp32 or bf16 only (no fsdp-bf16, HSDP, interleaved);
  - ``--layer-split`` with ``interleaved`` is refused (a rank's virtual stages are not contiguous);
  - P2P transfers complete at once: a real backend's staging copies (NCCL's, gloo's) are not seen.
"""

from __future__ import annotations

import contextlib

from trainmem.errors import SpecError, UnsupportedError
from trainmem.trace.parallel_fsdp import forget_meshes_of_other_worlds

__all__ = ["check_pp_flags", "check_pp", "pp_world", "apply_pp", "Pipeline", "pp_meta", "pp_line"]

#: torch.distributed.pipelining's schedule classes by ParallelSpec.schedule
_SCHEDULES = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B", "interleaved": "ScheduleInterleaved1F1B"}


def check_pp_flags(par, rank: int = 0) -> None:
    """Refuse, in one line, a pipeline layout the PP trace does not run."""
    if par.pp < 2:
        raise SpecError("pp", par.pp, "pipeline parallelism needs --pp N, N >= 2 stages")
    if par.schedule not in _SCHEDULES:
        raise UnsupportedError(f"--schedule {par.schedule}: trace runs gpipe, 1f1b and interleaved; estimate "
                               f"--schedule {par.schedule} gives the per-rank memory")
    for flag, value, single in (("cp", par.cp, 1), ("ep", par.ep, 1), ("zero", par.zero, 0)):
        if value != single:
            raise UnsupportedError(f"--{flag} {value} with --pp: trace runs pipeline parallelism alone or with "
                                   f"FSDP2 and/or TP; estimate --pp {par.pp} --{flag} {value} gives the per-rank "
                                   "memory")
    if par.tp > 1:  # TP inside each stage (trace/parallel_tp.py), on the stage's tp mesh slice
        from dataclasses import replace

        from trainmem.trace.parallel_tp import check_tp_flags
        check_tp_flags(replace(par, pp=1))
        if par.schedule == "interleaved":  # stage 1's forward fails in torch 2.13's runtime schedule (not read into)
            raise UnsupportedError("--schedule interleaved with --pp and --tp: trace runs TP stages under gpipe and "
                                   "1f1b; estimate gives the per-rank memory")
    if par.dp > 1 and par.fsdp is None:
        raise UnsupportedError(f"--dp {par.dp} with --pp: trace runs each stage FSDP2-sharded (--fsdp full), not "
                               f"replicated; estimate --pp {par.pp} --dp {par.dp} gives the per-rank memory")
    if par.fsdp is not None:
        if par.fsdp != "full" or par.fsdp_version != 2 or par.fsdp_units != "blocks":
            raise UnsupportedError(f"--fsdp {par.fsdp} (version {par.fsdp_version}, units {par.fsdp_units}) with "
                                   "--pp: trace runs FSDP2 full sharding per block and stage; estimate gives the "
                                   "per-rank memory")
        if par.dp < 2:
            raise SpecError("dp", par.dp, "--fsdp full with --pp needs --dp N, N >= 2 ranks per stage")
        if par.schedule == "interleaved":
            raise UnsupportedError("--schedule interleaved with --pp and --fsdp: trace runs FSDP2 under gpipe and "
                                   "1f1b; estimate gives the per-rank memory")
    if par.offload:
        raise UnsupportedError(f"--offload {','.join(par.offload)} with --pp: trace runs every stage's states on "
                               "the device; estimate gives the per-rank memory")
    if par.schedule == "interleaved" and par.layer_split:
        raise UnsupportedError("--layer-split with --schedule interleaved: trace splits a rank's virtual stages "
                               "evenly; estimate gives the per-rank memory")
    if not 0 <= rank < par.pp:
        raise SpecError("pp_rank", rank, f"must be a pipeline rank, 0 to {par.pp - 1}")
    m = par.microbatches
    if par.schedule == "1f1b" and m < par.pp:  # Schedule1F1B.__init__ (schedules.py)
        raise SpecError("microbatches", m, f"1f1b needs at least as many micro-batches as stages (pp={par.pp})")
    if par.schedule == "interleaved" and m % max(1, m // par.pp):  # ScheduleInterleaved1F1B.__init__
        raise SpecError("microbatches", m, f"interleaved 1f1b needs a multiple of its rounds "
                                           f"(max(1, microbatches // pp) = {max(1, m // par.pp)})")


def check_pp(par, step, impl, finetune=None, config=None, rank: int = 0) -> None:
    """Refuse, in one line, what the PP trace does not run; a config.json dict of a family the
    estimator reads has its layers checked against the layout before the model is built
    (:func:`stage_layers_of`)."""
    from collections.abc import Mapping

    from trainmem.specs import ModelSpec

    check_pp_flags(par, rank)
    if par.tp > 1:  # the TP trace's own checks: plan sizes, compile after the cut (trace/parallel_tp.py)
        from dataclasses import replace

        from trainmem.trace.parallel_tp import check_tp
        check_tp(replace(par, pp=1), step, impl, finetune, config=config)
    if isinstance(config, ModelSpec):
        raise UnsupportedError("--pp: trace cuts a transformers model into stages; trainmem's reference model is "
                               "not cut (use --profile hf, or estimate --pp)")
    if impl.compile and (impl.compile_scope not in ("block", "block-loss") or par.schedule == "interleaved"):
        # per-block compile of the stage's own blocks (and, block-loss, torchtitan's default components
        # ["model", "loss"], the stage's loss_function), one stage per rank: an interleaved rank's virtual
        # stages hold their own copies of the block table (_cut)
        what = (f"--compile-scope {impl.compile_scope}" if impl.compile_scope not in ("block", "block-loss")
                else "--schedule interleaved")
        raise UnsupportedError(f"--compile with --pp and {what}: trace compiles each stage's blocks "
                               "(--compile-scope block or block-loss) under gpipe and 1f1b; estimate gives the "
                               "per-rank memory")
    for what, given in (("--float8", impl.float8 != "none"),
                        ("--optimizer-in-backward", impl.optimizer_in_backward),
                        ("fine-tuning (--finetune/--freeze)", finetune is not None),
                        (f"--loss {step.loss}", step.loss != "ce"),
                        (f"--grad-accum {step.grad_accum}", step.grad_accum != 1)):
        if given:
            raise UnsupportedError(f"{what} with --pp: trace runs the pipeline schedule's own step (micro-batches "
                                   "are its accumulation, cross-entropy its loss); estimate --pp gives the "
                                   "per-rank memory")
    if step.dtypes.gathered:
        raise UnsupportedError(f"precision={step.precision!r} needs FSDP2; trace --pp runs without it: use amp-bf16")
    if isinstance(config, Mapping):
        from trainmem.specs.loaders import SUPPORTED_MODEL_TYPES, spec_from_hf_config
        if config.get("model_type") in SUPPORTED_MODEL_TYPES:  # before the model is built
            stage_layers_of(par, spec_from_hf_config(dict(config)).num_layers)


@contextlib.contextmanager
def pp_world(par, rank: int):
    """Rank ``rank`` of ``par.pp`` in torch's fake process group; destroyed on exit. Made outside
    ``FakeTensorMode``."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if not dist.is_available():  # pragma: no cover - torch built without distributed
        raise UnsupportedError("tracing pipeline parallelism needs torch.distributed")
    if dist.is_initialized():
        raise UnsupportedError("a torch.distributed process group is already initialised in this process; "
                               "trace --pp starts its own fake group: call it outside your distributed job")
    # with FSDP2 the ranks form a (pp, dp) mesh (apply_pp), with TP a (pp[, dp], tp) one: this rank is (rank, 0[, 0])
    dist.init_process_group("fake", store=FakeStore(), rank=rank * par.dp * par.tp,
                            world_size=par.pp * par.dp * par.tp)
    try:
        if par.tp == 1:
            yield None, None  # no device mesh (the pipeline uses the default group)
        else:  # torchtitan's (pp, dp_shard, tp) mesh: the stage's TP slice; P2P and FSDP2 use the others (apply_pp)
            from torch.distributed.device_mesh import init_device_mesh
            forget_meshes_of_other_worlds()
            dims = (("pp", par.pp),) + ((("dp", par.dp),) if par.fsdp is not None else ()) + (("tp", par.tp),)
            yield None, init_device_mesh("cpu", tuple(n for _, n in dims), mesh_dim_names=tuple(k for k, _ in dims))["tp"]
    finally:
        dist.destroy_process_group()
        forget_meshes_of_other_worlds()


def stage_ids(par, rank: int) -> list[int]:
    """The global stages rank ``rank`` runs (torchtitan's ``stage_ids_this_rank``, style "loop")."""
    v = par.virtual_stages if par.schedule == "interleaved" else 1
    return [rank + j * par.pp for j in range(v)]


def stage_layers_of(par, num_layers: int) -> list[tuple[int, int]]:
    """[start, end) layers of every global stage, refused in one line where the layers cannot take
    the layout. One stage per rank: the estimate's split and checks (``estimate/parallel_pp.py``
    ``stage_layers``, ``estimate/parallel.py`` ``validate``: ``--layer-split``, or an even split with the
    remainder on the first stages), restated here because the tracer cannot import the estimator
    (``estimate.traced`` imports the tracer); interleaved: ``L / (pp·v)`` layers per stage."""
    if par.pp > num_layers:
        raise SpecError("pp", par.pp, f"exceeds the model's {num_layers} layers")
    if par.schedule == "interleaved":
        n = par.pp * par.virtual_stages
        if num_layers % n:
            raise SpecError("virtual_stages", par.virtual_stages,
                            f"pp × virtual_stages = {n} must divide the {num_layers} layers")
        return [(g * (num_layers // n), (g + 1) * (num_layers // n)) for g in range(n)]
    sizes = list(par.layer_split)
    if sizes and (len(sizes) != par.pp or sum(sizes) != num_layers or min(sizes) < 1):
        raise SpecError("layer_split", par.layer_split, f"needs pp={par.pp} positive entries summing to "
                                                        f"{num_layers} layers")
    base, rem = divmod(num_layers, par.pp)
    sizes = sizes or [base + (s < rem) for s in range(par.pp)]
    return [(sum(sizes[:s]), sum(sizes[:s + 1])) for s in range(par.pp)]


def _parts(model):
    """The base model and output layer of a Llama-like causal LM, or a one-line refusal."""
    base, head = getattr(model, "model", None), getattr(model, "lm_head", None)
    if base is None or head is None or not all(hasattr(base, a) for a in ("embed_tokens", "layers", "norm")):
        raise UnsupportedError(f"{type(model).__name__}: trace --pp cuts Llama-like decoders (model.embed_tokens, "
                               "model.layers, model.norm, lm_head); estimate --pp gives the per-rank memory")
    return base, head


def _stage_class():
    from torch import nn

    class PipelineStageModule(nn.Module):
        """One pipeline stage: the Hugging Face base model restricted to the stage's layers (token
        ids in on the first stage, the residual stream after), and the output layer on the last.
        ``loss_function`` is the schedule's loss, settable as transformers' ``PreTrainedModel.loss_function``
        is (``trace/compiled.py`` compiles it in its place under ``--compile-scope block-loss``)."""

        def __init__(self, base, lm_head, config, first: bool, loss, sp_mesh=None) -> None:
            super().__init__()
            self.model = base
            self.lm_head = lm_head
            self.config = config
            self._first = first
            self._hf_loss = loss
            self._sp_mesh = sp_mesh

        @property
        def loss_function(self):
            return self.__dict__.get("_loss_function", self._hf_loss)

        @loss_function.setter
        def loss_function(self, value):
            self.__dict__["_loss_function"] = value

        def forward(self, x):
            if self._sp_mesh is not None and not self._first:  # TP+SP: the received local S/tp tokens
                from torch.distributed.tensor import DTensor, Shard
                x = DTensor.from_local(x, self._sp_mesh, [Shard(1)], run_check=False)
            # no KV cache: torchtitan's stage models have none, and with transformers' default (config.use_cache)
            # each block would hand its K/V to a DynamicCache, which under --compile makes them graph outputs whose
            # gradients AOTAutograd materializes as zeros in backward (measured against the real run,
            # tests/trace/test_trace_3d_real.py)
            out = (self.model(input_ids=x, use_cache=False) if self._first
                   else self.model(inputs_embeds=x, use_cache=False))
            h = out.last_hidden_state
            if self.lm_head is not None:
                return self.lm_head(h)
            return h.to_local() if self._sp_mesh is not None else h  # sent as the rank's local tokens

    return PipelineStageModule


def _cut(base, layers: tuple[int, int], *, first: bool, last: bool):
    """``base`` (a shallow module copy: its own child table) keeping ``layers`` by their original
    keys (torchtitan deletes a ModuleDict's keys; a ModuleList's ``del`` would renumber them), the
    embedding on the first stage, the final norm on the last (an identity elsewhere)."""
    import copy

    from torch import nn

    out = copy.copy(base)
    out._modules = dict(base._modules)
    kept = copy.copy(base.layers)
    kept._modules = {k: m for k, m in base.layers._modules.items() if layers[0] <= int(k) < layers[1]}
    out._modules["layers"] = kept
    if not first:
        out._modules["embed_tokens"] = None
    if not last:
        out._modules["norm"] = nn.Identity()
    return out


def apply_pp(model, par, rank: int, step):
    """Cut ``model`` into rank ``rank``'s stages and wrap each in a ``PipelineStage`` under the
    schedule; returns the module holding the rank's parameters (named as in the whole model) and
    the :class:`Pipeline` to step."""
    import torch

    from trainmem.trace.torch_state import torch_dtype

    base, head = _parts(model)
    num_layers = len(base.layers)
    bounds = stage_layers_of(par, num_layers)
    ids = stage_ids(par, rank)
    total = len(bounds)
    first_rank, last_rank = ids[0] == 0, ids[-1] == total - 1
    Stage = _stage_class()
    # the rank's parameters in one module, named as in the whole model (the stages share its modules)
    lo, hi = min(bounds[g][0] for g in ids), max(bounds[g][1] for g in ids)
    kept = {g for s in ids for g in range(*bounds[s])}
    rank_base = _cut(base, (lo, hi), first=first_rank, last=last_rank)
    rank_base.layers._modules = {k: m for k, m in rank_base.layers._modules.items() if int(k) in kept}
    loss = model.loss_function  # Hugging Face's causal-LM cross-entropy (loss/loss_utils.py ForCausalLMLoss)
    tp_mesh = _tp_mesh(model) if par.tp > 1 else None  # parallel_tp.apply_tp ran on the whole model first
    sp_mesh = tp_mesh if par.sp else None
    rank_model = Stage(rank_base, head if last_rank else None, model.config, first_rank, loss, sp_mesh)
    if len(ids) == 1:
        mods = [rank_model]
    else:
        mods = [Stage(_cut(rank_base, bounds[g], first=g == 0, last=g == total - 1),
                      head if g == total - 1 else None, model.config, g == 0, loss, sp_mesh) for g in ids]
    del model
    root = tp_mesh._get_root_mesh() if tp_mesh is not None else None
    group = (_shard_stages(mods, par, step, root) if par.fsdp is not None
             else root["pp"].get_group() if root is not None else None)
    B, S, H = step.batch, step.seq // (par.tp if par.sp else 1), base.config.hidden_size
    act = torch_dtype(step.dtypes.param)  # the residual stream's dtype (RMSNorm and the adds keep it)
    V = rank_model.config.vocab_size
    from torch.distributed.pipelining import PipelineStage
    stages = []
    for g, mod in zip(ids, mods):
        x = torch.randint(0, V, (B, step.seq)) if g == 0 else torch.empty(B, S, H, dtype=act, requires_grad=True)
        y = torch.empty(B, S, V if g == total - 1 else H, dtype=act, requires_grad=True)
        stages.append(PipelineStage(mod, g, total, torch.device("cpu"), input_args=x, output_args=y, group=group))
    return rank_model, Pipeline(par, stages, rank_model, step)


def _tp_mesh(model):
    """The TP mesh the model's DTensor parameters live on (a ``tp`` slice of the (pp, tp) mesh, pp_world)."""
    from torch.distributed.tensor import DTensor

    return next(p.device_mesh for p in model.parameters() if isinstance(p, DTensor))


def _shard_stages(mods, par, step, root=None):
    """FSDP2 on each stage over the data-parallel mesh dimension, as torchtitan's ``apply_fsdp`` under
    PP and ``measure_dist/worker.py`` (``pp_dp``): ``fully_shard`` every block, then the stage as the
    root; the (pp, dp) mesh is made with fake tensors off (it reads its ranks back). With TP the mesh is
    ``root``, pp_world's (pp, dp, tp) one, and FSDP2 shards the blocks' TP-local DTensor shards over ``dp``
    (as trace/parallel_2d.py). Returns the pipeline's process group (the mesh's ``pp`` dimension)."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    from torch.distributed.device_mesh import init_device_mesh

    from trainmem.trace.parallel_2d import meshes_on_real_tensors

    mesh = root
    if mesh is None:
        with unset_fake_temporarily():
            mesh = init_device_mesh("cpu", (par.pp, par.dp), mesh_dim_names=("pp", "dp"))
    with meshes_on_real_tensors():  # FSDP2 over TP concatenates meshes (DeviceMesh._concatenate)
        _fully_shard_stages(mods, mesh["dp"], par)
    return mesh["pp"].get_group()


def _fully_shard_stages(mods, mesh, par) -> None:
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    for mod in mods:
        for layer in mod.model.layers:
            fully_shard(layer, mesh=mesh, reshard_after_forward=par.reshard_after_forward,
                        mp_policy=MixedPrecisionPolicy())
        fully_shard(mod, mesh=mesh, reshard_after_forward=par.reshard_after_forward,
                    mp_policy=MixedPrecisionPolicy())


class Pipeline:
    """A rank's schedule and what one of its steps takes: the whole batch's token ids on the
    first stage, the targets on the last (``sched.step(ids)`` / ``step(target=ids)``, as
    torchtitan's train step calls it)."""

    def __init__(self, par, stages, rank_model, step) -> None:
        import torch
        import torch.distributed.pipelining as pipelining
        from torch.distributed.pipelining._utils import InferenceMode

        self.par, self.stages = par, stages
        vocab = rank_model.config.vocab_size
        def loss_fn(logits, labels):  # Hugging Face's causal-LM cross-entropy, as model(ids, labels=ids)
            return rank_model.loss_function(logits, labels, vocab_size=vocab)

        cls = getattr(pipelining, _SCHEDULES[par.schedule])
        self.schedule = cls(stages if par.schedule == "interleaved" else stages[0], n_microbatches=par.microbatches,
                            loss_fn=loss_fn)

        def warmup(stages, has_backward, p2p_done):  # every stage has static shapes: the vote's outcome
            for s in stages:
                s._inference_mode = InferenceMode.STATIC

        self.schedule._warmup_p2p = warmup
        self.first = any(s.is_first for s in stages)
        self.last = any(s.is_last for s in stages)
        self.ids = torch.randint(0, vocab, (step.batch * par.microbatches, step.seq))
        self._mb = step.batch

    def microbatch_forward(self, stage_module):
        """One micro-batch through ``stage_module`` (this rank's one stage) as the schedule runs it: its
        input the first micro-batch's ids, or on a later stage a received (B, S, H) tensor needing a gradient
        (``_retrieve_recv_activations``: the receive buffer, detached); on the last stage the loss. What
        ``trace/compiled.py`` ``report`` measures the saved sets of. The ids are copied: the schedule's
        micro-batches are views of the whole batch's ids (``tensor_split``), the step's input, whose storage
        the saved-tensor hooks would count whole."""
        import torch

        (stage,) = self.stages
        ids = self.ids[:self._mb].clone()
        if self.first:
            x = ids
        else:
            info = stage.args_recv_info[0][0]
            x = torch.empty(info.buffer.shape, dtype=info.buffer.dtype, requires_grad=True)
        out = stage_module(x)
        return stage_module.loss_function(out, ids, vocab_size=stage_module.config.vocab_size) if self.last else out

    @property
    def inputs(self) -> dict:
        """The step's input tensors on this rank (ids on the first stage, targets on the last)."""
        return {"input_ids": self.ids} if self.first or self.last else {}

    def step(self) -> None:
        kwargs = {"target": self.ids, "losses": []} if self.last else {}
        with _sends_hold_their_tensors():
            self.schedule.step(*((self.ids,) if self.first else ()), **kwargs)

    def register(self, tracer, rank_model) -> None:
        """Tell ``tracer`` about the receive buffers and, under FSDP2, the storages FSDP resizes in place."""
        for t, name in zip(*self.buffers()):
            tracer.mark_buffer(t, name)  # kept across steps
        if self.par.fsdp is not None:
            from trainmem.trace.parallel_fsdp import unsharded_storages
            tracer.watch_resizable(*unsharded_storages(rank_model))

    def buffers(self) -> tuple[list, list[str]]:
        """The receive buffers each stage keeps across steps, one per micro-batch and direction."""
        tensors, names = [], []
        for st in self.stages:
            for what, table in (("activations", st.args_recv_info), ("gradients", st.grad_recv_info)):
                for mb, infos in sorted(table.items()):
                    for info in infos:
                        if getattr(info, "buffer", None) is not None:
                            tensors.append(info.buffer)
                            names.append(f"pipeline.stage{st.stage_index}.recv_{what}.{mb}")
        return tensors, names


class _HeldWork:
    """A send's ``Work`` that references the sent tensors until the schedule drops it."""

    def __init__(self, work, tensors) -> None:
        self._work, self._tensors = work, tensors

    def wait(self, *args, **kwargs):
        return self._work.wait(*args, **kwargs)


@contextlib.contextmanager
def _sends_hold_their_tensors():
    """A real backend's send ``Work`` keeps its tensor until the Work is destroyed (gloo's send work
    holds it; NCCL stashes it for the caching allocator), and the schedules keep some Works past the
    sent tensor's backward (``Schedule1F1B._step_microbatches`` keeps the first warm-up send in
    ``send_work`` until the steady phase ends; ``ScheduleGPipe`` keeps every forward send in
    ``fwd_sends_to_wait``; ``_PipelineScheduleRuntime``, the interleaved schedule, every send in
    ``send_ops`` until its last action). The fake group's Works hold nothing, so each send's Work is wrapped to
    hold its tensors for as long as the schedule holds the Work (``schedules.py`` ``_batch_p2p``)."""
    import torch.distributed as dist
    from torch.distributed.pipelining import schedules

    original = schedules._batch_p2p

    def batch_p2p(p2p_ops, desc=None):
        works = original(p2p_ops, desc=desc)
        sent = [op.tensor for op in p2p_ops if op.op is dist.isend]
        return [_HeldWork(w, sent) for w in works] if sent else works

    schedules._batch_p2p = batch_p2p
    try:
        yield
    finally:
        schedules._batch_p2p = original


def pp_meta(par, rank: int) -> dict:
    """What the result states about the pipeline it ran."""
    out = {"pp": par.pp, "rank": rank, "schedule": par.schedule, "microbatches": par.microbatches,
           "stages": stage_ids(par, rank), "process_group": "fake"}
    if par.fsdp is not None:
        out["fsdp"] = {"dp": par.dp, "dp_rank": 0, "reshard_after_forward": par.reshard_after_forward}
    return out


def pp_line(meta: dict) -> str:
    """What a pipeline trace ran, in one line."""
    stages = ", ".join(str(s) for s in meta["stages"])
    return (f"pipeline: rank {meta['rank']} of {meta['pp']} (torch's fake process group), stage(s) {stages}, "
            f"{meta['schedule']} over {meta['microbatches']} micro-batches (torch.distributed.pipelining); "
            f"other ranks: --pp-rank"
            + (f"; each stage FSDP2-sharded over {meta['fsdp']['dp']} ranks (traced: data-parallel rank 0)"
               if "fsdp" in meta else ""))
