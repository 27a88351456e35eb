"""One rank of a measured distributed training step; run by :func:`launch.run_torchrun`.

``python -m trainmem.measure_dist.worker '<scenario json>'`` under torchrun (gloo, CPU). The
rank builds a tiny Hugging Face model from ``scenario["config"]``, applies one strategy, runs
three steps (AdamW ``foreach=True``, ``zero_grad(set_to_none=True)``) and measures the third
(DDP rebuilds its gradient buckets in the second):

* ``activation_bytes``: distinct local storages saved for backward by one micro-batch's
  forward + loss (parameters excluded);
* ``states_bytes``: local parameter shards, gradients, optimizer states, step counters,
  buffers, and ``comm_buffer`` (DDP gradient buckets that are not the gradients themselves);
* ``peak_bytes``: the live-set peak of the whole step (``tracking.LiveTracker``), with
  ``baseline_bytes`` (alive before it) and ``inflight_activation_bytes`` (most saved
  activation bytes alive at once; several micro-batches under pipelining).

Strategies: ``single``, ``ddp``, ``fsdp`` (FSDP2 ``fully_shard`` per decoder layer and root; HSDP on a
(dp_replicate, dp_shard) mesh with ``hsdp_replicas`` > 1),
``fsdp1`` (``FullyShardedDataParallel``, ``use_orig_params=True``, one unit per decoder layer as
HF/accelerate's transformer auto-wrap),
``tp`` (DTensor ``parallelize_module``, optional sequence parallel; with ``tp_dp`` > 1 then FSDP2 on a
(dp_shard, tp) mesh, torchtitan's 2-D layout; with ``compile`` ``"partition"`` or ``"inductor"`` each decoder
layer then ``torch.compile``-d, :func:`_compile_blocks`), ``pp``
(``torch.distributed.pipelining``, one stage per rank, GPipe or 1F1B, or ``virtual_stages`` per
rank under interleaved 1F1B, torchtitan's looped stage ids; with ``pp_dp`` > 1 the
ranks form a (pp, dp) mesh and every stage is FSDP2-sharded over its dp group, as torchtitan's
PP + FSDP: the schedule keeps unsharded gradients until the last micro-batch; with ``pp_tp`` > 1 a (pp[, dp], tp)
mesh, torchtitan's 3-D layout: each stage cut, then ``_apply_tp`` on its ``tp`` slice, then FSDP2 on ``dp``; under
sequence parallelism the stages exchange the rank's local S/tp tokens, :func:`_pipeline_stage_module`).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from trainmem.measure_dist.tracking import (
    LiveTracker, fsdp_unsharded_tensors, local, parameter_storage_keys, saved_activations, storage_bytes,
)

__all__ = ["DEFAULTS", "STRATEGIES", "main", "run"]

STRATEGIES = ("single", "ddp", "fsdp", "fsdp1", "tp", "pp")

#: Tiny Llama: every sharded dimension divides by 4, so FSDP2 shards carry no padding.
DEFAULT_CONFIG = dict(model_type="llama", hidden_size=64, intermediate_size=176, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, vocab_size=256,
                      max_position_embeddings=256, tie_word_embeddings=False)

DEFAULTS = dict(strategy="single", config=DEFAULT_CONFIG, batch=2, seq=64, precision="fp32",
                attention="sdpa", seed=0,
                gradient_as_bucket_view=False,  # ddp
                reshard_after_forward=True,     # fsdp
                mp_param_dtype=None,            # fsdp: "bf16" -> MixedPrecisionPolicy(bf16, reduce fp32)
                freeze=(),                      # parameter-name substrings set requires_grad=False
                lora=False,                     # peft LoRA r=8 on q_proj, v_proj (the base frozen)
                sp=False,                       # tp
                loss_parallel=True,             # tp: vocab-sharded logits and loss (torchtitan's default)
                profile_step=False,             # three more steps under torch.profiler(profile_memory=True),
                                                # then three op-boundary-tracked ones (unless tracked_repeats)
                tracked_repeats=0,              # more op-boundary-tracked steps (gloo's release race only adds bytes)
                schedule="gpipe", microbatches=4,  # pp; batch is the micro-batch size
                virtual_stages=1,                  # pp: stages per rank under schedule "interleaved"
                pp_dp=1,                           # pp: FSDP2 degree of each stage (world = pp × pp_dp)
                pp_tp=1,                           # pp: TP degree inside each stage (world = pp × pp_dp × pp_tp)
                hsdp_replicas=1,                   # fsdp: > 1 is HSDP, mesh (dp_replicate, dp_shard)
                tp_dp=1,                           # tp: > 1 adds FSDP2 over a (dp_shard, tp) mesh (world = tp_dp × tp)
                root_reshard_auto=True)            # fsdp, tp_dp: the root's reshard_after_forward left to FSDP2


def _dtype(precision: str):
    import torch

    return {"fp32": torch.float32, "bf16": torch.bfloat16}[precision]


#: Where _apply_tp finds the parts it cuts: a Hugging Face causal LM, and a pipeline stage (_pipeline_stage_module)
HF_PARTS = dict(embed="model.embed_tokens", norm="model.norm", head="lm_head", layers="model.layers")
STAGE_PARTS = dict(embed="embed_tokens", norm="norm", head="lm_head", layers="layers")


def _module_at(model, name: str):
    for attr in name.split("."):
        model = getattr(model, attr, None)
    return model


def _apply_tp(model, mesh, sp: bool, loss_parallel: bool = True, parts: dict = HF_PARTS) -> None:
    """torchtitan's Llama plan on Hugging Face module names (``parts``: where the embedding, final norm,
    output layer and blocks are; a pipeline stage lacks some, whose entries are left out of the plan: torchtitan
    runs ``apply_tp`` on each stage model, its missing parts None); with ``sp`` the residual stream is
    a DTensor sharded over the sequence (dim 1) and norms run on the local tokens. With
    ``loss_parallel`` the logits stay vocab-sharded for a vocab-parallel loss (torchtitan's
    default); without, they are all-gathered to the full vocabulary, a plain tensor on every rank
    (torchtitan/models/llama3/infra/parallelize.py, apply_tp: ``output_layouts=Shard(-1) if
    loss_parallel else Replicate(), use_local_output=not loss_parallel``)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel, PrepareModuleInput, RowwiseParallel, SequenceParallel, parallelize_module,
    )

    out = dict(output_layouts=Shard(-1) if loss_parallel else Replicate(), use_local_output=not loss_parallel)
    embed, norm, head = parts["embed"], parts["norm"], parts["head"]
    if sp:
        top = {embed: RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1), use_local_output=False),
               norm: SequenceParallel(),
               head: ColwiseParallel(input_layouts=Shard(1), **out)}
    else:
        top = {embed: RowwiseParallel(input_layouts=Replicate()),
               head: ColwiseParallel(**out)}
    parallelize_module(model, mesh, {k: v for k, v in top.items() if _module_at(model, k) is not None})
    for layer in _module_at(model, parts["layers"]):
        plan = {"self_attn.q_proj": ColwiseParallel(), "self_attn.k_proj": ColwiseParallel(),
                "self_attn.v_proj": ColwiseParallel(), "mlp.gate_proj": ColwiseParallel(),
                "mlp.up_proj": ColwiseParallel()}
        if sp:
            plan.update({
                "input_layernorm": SequenceParallel(),
                "self_attn": PrepareModuleInput(input_kwarg_layouts={"hidden_states": Shard(1)},
                                                desired_input_kwarg_layouts={"hidden_states": Replicate()}),
                "self_attn.o_proj": RowwiseParallel(output_layouts=Shard(1), use_local_output=False),
                "post_attention_layernorm": SequenceParallel(),
                "mlp": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
                "mlp.down_proj": RowwiseParallel(output_layouts=Shard(1), use_local_output=False),
            })
        else:
            plan.update({"self_attn.o_proj": RowwiseParallel(), "mlp.down_proj": RowwiseParallel()})
        parallelize_module(layer, mesh, plan)


def _apply_fsdp(model, mesh, sc: dict) -> None:
    """``fully_shard`` each decoder layer, then the root, over ``mesh`` (None: every rank)."""
    import torch
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mp = (MixedPrecisionPolicy(param_dtype=_dtype(sc["mp_param_dtype"]), reduce_dtype=torch.float32)
          if sc["mp_param_dtype"] else MixedPrecisionPolicy())
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh, reshard_after_forward=sc["reshard_after_forward"], mp_policy=mp)
    # torchtitan's apply_fsdp leaves the root's to FSDP2, which keeps the root gathered (FSDPState._lazy_init)
    root = {} if sc["root_reshard_auto"] else {"reshard_after_forward": sc["reshard_after_forward"]}
    fully_shard(model, mesh=mesh, mp_policy=mp, **root)


def _compile_blocks(model, backend: str) -> list:
    """torchtitan's ``apply_compile`` after ``apply_tp`` (torchtitan/models/llama3/infra/parallelize.py):
    each decoder layer replaced by its ``torch.compile``-d wrapper. ``backend`` ``"partition"``: trainmem's
    (``trace/compiled.py`` ``partitioning_backend``: inductor's decompositions and partition, the graphs run
    as they are, no codegen), whose partitioned regions' saved values fill the returned list as they are
    compiled (name, shape, dtype, bytes); any other string is handed to ``torch.compile`` (``"inductor"``)."""
    import torch

    from trainmem.trace.compiled import Compiled, partitioning_backend

    record = Compiled()
    chosen = partitioning_backend(record) if backend == "partition" else backend
    regions: list = []
    record.regions = _RegionList(regions)
    layers = model.model.layers
    for name, layer in list(layers.named_children()):
        layers.register_module(name, torch.compile(layer, backend=chosen, dynamic=False))
    return regions


class _RegionList(list):
    """The record's regions, appended to ``out`` as plain lists (JSON)."""

    def __init__(self, out: list) -> None:
        super().__init__()
        self._out = out

    def append(self, saved) -> None:
        super().append(saved)
        self._out.append([[v.name, list(v.shape), v.dtype, v.nbytes] for v in saved])


def _pipeline_stage_module(model, stage: int, num_stages: int, sp_mesh=None):
    """Stage ``stage`` of a Hugging Face Llama split by layers: stage 0 owns the embedding,
    the last stage the final norm and LM head (the loss runs in the schedule's ``loss_fn``).
    With ``sp_mesh`` (TP with sequence parallelism inside the stage) the residual stream crosses stages
    as the rank's local S/tp tokens: a stage sends its output's local tensor and wraps what it receives
    as a ``Shard(1)`` DTensor, as torchtitan's row-parallel outputs keep ``use_local_output`` (its plan,
    torchtitan/models/llama3/infra/parallelize.py ``apply_tp``, leaves the residual stream plain local
    tokens between blocks; this plan keeps DTensors inside the stage)."""
    import torch
    from torch import nn

    layers = model.model.layers
    per = len(layers) // num_stages
    first, last = stage == 0, stage == num_stages - 1

    class Stage(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed_tokens = model.model.embed_tokens if first else None
            self.layers = nn.ModuleList(layers[stage * per:(stage + 1) * per])
            self.rotary_emb = model.model.rotary_emb
            self.norm = model.model.norm if last else None
            self.lm_head = model.lm_head if last else None

        def forward(self, x):
            if sp_mesh is not None and not first:
                from torch.distributed.tensor import DTensor, Shard
                x = DTensor.from_local(x, sp_mesh, [Shard(1)], run_check=False)
            h = self.embed_tokens(x) if first else x
            pos = torch.arange(h.shape[1]).unsqueeze(0)
            pe = self.rotary_emb(h, pos)
            for layer in self.layers:
                h = layer(h, position_embeddings=pe, position_ids=pos)  # no mask: SDPA is_causal
            if last:
                h = self.lm_head(self.norm(h))
            elif sp_mesh is not None:
                h = h.to_local()  # sent as the rank's local tokens
            return h

    return Stage()


def _pipeline_buffers(*stages) -> list:
    """The receive buffers a ``PipelineStage`` allocates per micro-batch and reuses every step."""
    out = []
    for stage in stages:
        for table in (stage.args_recv_info, stage.grad_recv_info):
            for infos in table.values():
                out.extend(getattr(i, "buffer", None) for i in infos)
    return [t for t in out if t is not None]


def run(scenario: dict, rank: int, world: int) -> dict:
    import torch
    import torch.distributed as dist

    from trainmem.models.hf import build_hf_model

    sc = {**DEFAULTS, **scenario}
    strategy = sc["strategy"]
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy {strategy!r} is not one of {STRATEGIES}")
    cfg = dict(sc["config"])
    B, S, V = sc["batch"], sc["seq"], cfg["vocab_size"]
    torch.manual_seed(sc["seed"])  # identical weights on every rank
    model = build_hf_model(cfg, attention=sc["attention"], dtype=_dtype(sc["precision"]))
    hf_loss = model.loss_function  # shift labels, upcast logits, cross-entropy: as model(ids, labels=ids)
    loss_fn = lambda logits, labels: hf_loss(logits, labels, vocab_size=V)  # noqa: E731
    extra: dict = {}
    buckets: dict[int, object] = {}
    pp_dp = sc["pp_dp"] if strategy == "pp" else 1
    pp_tp = sc["pp_tp"] if strategy == "pp" else 1  # the tp ranks of one (pp, dp) rank read the same batch
    data_rank = rank if strategy in ("ddp", "fsdp", "fsdp1") else (rank // pp_tp) % pp_dp
    if strategy == "tp" and sc["tp_dp"] > 1:  # the tp ranks of one dp_shard rank read the same batch
        data_rank = rank // (world // sc["tp_dp"])
    for name, p in model.named_parameters():
        if any(f in name for f in sc["freeze"]):
            p.requires_grad_(False)
    if sc["lora"]:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=8, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    gen = torch.Generator().manual_seed(1000 + data_rank)
    nmb = sc["microbatches"] if strategy == "pp" else 1
    ids = torch.randint(0, V, (B * nmb, S), generator=gen)

    if strategy == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

        net = DDP(model, gradient_as_bucket_view=sc["gradient_as_bucket_view"])

        def hook(state, bucket):  # the default allreduce, recording the bucket it reduces
            buckets[bucket.buffer().untyped_storage()._cdata] = bucket.buffer()
            return allreduce_hook(state, bucket)

        net.register_comm_hook(None, hook)
    elif strategy == "fsdp":
        from torch.distributed.device_mesh import init_device_mesh

        replicas = sc["hsdp_replicas"]  # HSDP: fully_shard on a 2-D mesh shards over its last dimension
        mesh = (init_device_mesh("cpu", (replicas, world // replicas), mesh_dim_names=("dp_replicate", "dp_shard"))
                if replicas > 1 else None)
        _apply_fsdp(model, mesh, sc)
        net = model
    elif strategy == "fsdp1":
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy

        block = type(next(m for n, m in model.named_modules() if n.endswith("layers.0")))
        net = FSDP(model, auto_wrap_policy=ModuleWrapPolicy({block}), use_orig_params=True,
                   device_id=torch.device("cpu"))
    elif strategy == "tp":
        from torch.distributed.device_mesh import init_device_mesh

        if sc["tp_dp"] > 1:  # torchtitan's 2-D layout: apply_tp on the tp sub-mesh, then apply_fsdp on dp_shard
            mesh = init_device_mesh("cpu", (sc["tp_dp"], world // sc["tp_dp"]), mesh_dim_names=("dp_shard", "tp"))
            _apply_tp(model, mesh["tp"], sc["sp"], sc["loss_parallel"])
            _apply_fsdp(model, mesh["dp_shard"], sc)
        else:
            _apply_tp(model, init_device_mesh("cpu", (world,)), sc["sp"], sc["loss_parallel"])
        if sc.get("compile"):  # not in DEFAULTS: the eager scenarios' results stay as they were
            extra["compiled_regions"] = _compile_blocks(model, sc["compile"])
        net = model
    else:
        net = model

    import contextlib

    loss_context = contextlib.nullcontext
    if (strategy == "tp" or pp_tp > 1) and sc["loss_parallel"]:  # torchtitan/distributed/utils.py, get_train_context
        from torch.distributed.tensor.parallel import loss_parallel as loss_context

    if strategy == "pp":
        from torch import nn
        from torch.distributed.pipelining import (
            PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B,
        )

        npp, pp_rank, pp_group = world // (pp_dp * pp_tp), rank // (pp_dp * pp_tp), None
        v = sc["virtual_stages"] if sc["schedule"] == "interleaved" else 1
        stage_ids = [pp_rank + j * npp for j in range(v)]  # torchtitan's stage_ids_this_rank, style "loop"
        if pp_dp > 1 or pp_tp > 1:  # torchtitan's (pp, dp_shard, tp) mesh, its degree-1 dimensions left out
            from torch.distributed.device_mesh import init_device_mesh

            dims = [("pp", npp)] + [("dp", pp_dp)] * (pp_dp > 1) + [("tp", pp_tp)] * (pp_tp > 1)
            mesh = init_device_mesh("cpu", tuple(n for _, n in dims), mesh_dim_names=tuple(k for k, _ in dims))
            pp_group = mesh["pp"].get_group()
        sp_mesh = mesh["tp"] if pp_tp > 1 and sc["sp"] else None
        stage_mods = [_pipeline_stage_module(model, s, npp * v, sp_mesh) for s in stage_ids]
        stage_mod = stage_mods[0] if v == 1 else nn.ModuleList(stage_mods)
        del model
        model = stage_mod
        if pp_tp > 1:  # torchtitan's parallelize_fn per stage model: apply_tp first
            for mod in stage_mods:
                _apply_tp(mod, mesh["tp"], sc["sp"], sc["loss_parallel"], STAGE_PARTS)
        if pp_dp > 1:  # torchtitan's apply_fsdp on each stage: every block, then the stage as root
            from torch.distributed.fsdp import fully_shard

            for mod in stage_mods:
                for layer in mod.layers:
                    fully_shard(layer, mesh=mesh["dp"], reshard_after_forward=sc["reshard_after_forward"])
                fully_shard(mod, mesh=mesh["dp"], reshard_after_forward=sc["reshard_after_forward"])
        if sc.get("compile"):  # torchtitan: apply_compile on each stage model's blocks (after its apply_fsdp)
            from types import SimpleNamespace

            regions = [_compile_blocks(SimpleNamespace(model=mod), sc["compile"]) for mod in stage_mods]
            extra["compiled_regions"] = regions[0] if v == 1 else regions  # filled as the regions compile
        stages = [PipelineStage(mod, s, npp * v, torch.device("cpu"), group=pp_group)
                  for mod, s in zip(stage_mods, stage_ids)]
        if v > 1:
            sched = ScheduleInterleaved1F1B(stages, n_microbatches=nmb, loss_fn=loss_fn)
        else:
            cls = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[sc["schedule"]]
            sched = cls(stages[0], n_microbatches=nmb, loss_fn=loss_fn)
        last = pp_rank == npp - 1

        def forward_backward():
            with loss_context():  # TP: the last stage's vocab-sharded logits (torchtitan's train context)
                if pp_rank == 0:
                    sched.step(ids)
                elif last:
                    sched.step(target=ids, losses=[])
                else:
                    sched.step()
    else:
        def forward_backward():
            with loss_context():
                loss = net(ids, labels=ids).loss
                loss.backward()

    # foreach kernels refuse a mix of DTensor and plain tensors (TP without SP leaves the norms
    # plain), so DTensor parameters get their own group
    from torch.distributed.tensor import DTensor

    params = list(model.parameters())
    groups = [g for g in ([p for p in params if isinstance(p, DTensor)],
                          [p for p in params if not isinstance(p, DTensor)]) if g]
    opt = torch.optim.AdamW([{"params": g} for g in groups], lr=1e-4, foreach=True)
    grads_seen: dict = {}

    def step(record: bool = False):
        forward_backward()
        if record:
            grads_seen["gradient"] = storage_bytes(p.grad for p in model.parameters())
            grads_seen["logical"] = sum(local(p.grad).numel() * local(p.grad).element_size()
                                        for p in model.parameters() if p.grad is not None)
            grads_seen["keys"] = {local(p.grad).untyped_storage()._cdata
                                  for p in model.parameters() if p.grad is not None}
            if strategy == "fsdp1":  # the FlatParameters' own gradients (a rank whose chunk holds no
                # trainable weight still gets one; _reset_flat_param_grad_info_if_needed frees it next forward)
                from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

                flats = [m._handle.flat_param for m in FSDP.fsdp_modules(net) if m._handle is not None]
                extra["fsdp1_flat_grad_bytes"] = storage_bytes(fp.grad for fp in flats)
            grads_seen["items"] = [
                {"name": n, "shape": list(local(p).shape), "param_bytes": local(p).untyped_storage().nbytes(),
                 "grad_bytes": local(p.grad).untyped_storage().nbytes() if p.grad is not None else 0,
                 "grad_shape": list(local(p.grad).shape) if p.grad is not None else None,
                 "placements": str(getattr(p, "placements", "")),
                 "grad_placements": str(getattr(p.grad, "placements", ""))}
                for n, p in model.named_parameters()]
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()  # optimizer state and lazy strategy state exist from here on
    buckets.clear()  # DDP rebuilds its buckets in the order gradients became ready
    step()
    dist.barrier()

    # model states, read through local shards
    def opt_tensors(scalar: bool):
        for st in opt.state.values():
            for v in st.values():
                if isinstance(v, torch.Tensor) and (local(v).dim() == 0) == scalar:
                    yield v

    states = {"parameter": storage_bytes(model.parameters()),
              "optimizer_state": storage_bytes(opt_tensors(False)),
              "optimizer_step": storage_bytes(opt_tensors(True)),
              "buffer": storage_bytes(model.buffers())}

    # step 3, tracked
    unsharded = fsdp_unsharded_tensors(model)

    def new_tracker() -> LiveTracker:
        tracker = LiveTracker()
        tracker.watch(model.parameters())
        tracker.watch(model.buffers())
        tracker.watch(opt_tensors(False))
        tracker.watch(opt_tensors(True))
        tracker.watch(buckets.values())
        tracker.watch(unsharded)
        if strategy == "pp":  # one activation and one gradient receive buffer per micro-batch, kept across steps
            tracker.watch(_pipeline_buffers(*stages))
        tracker.saved_exclude = parameter_storage_keys(model)
        return tracker

    tracker = new_tracker()
    baseline = tracker.current_bytes()
    with tracker:
        step(record=True)
    states["gradient"] = grads_seen["gradient"]
    # a local gradient can be a view of a larger storage (DTensor's vocab-parallel embedding)
    states_logical_gradient = grads_seen["logical"]
    states["comm_buffer"] = storage_bytes(buckets.values(), exclude=grads_seen["keys"])
    dist.barrier()

    # saved activations of one micro-batch forward + loss, outside the schedule
    if strategy == "pp":
        mb = ids[:B].clone()  # the schedule's micro-batches are views of ``ids``: count one micro-batch
        S_in = S // pp_tp if sp_mesh is not None else S  # a later stage receives the rank's local tokens
        if v > 1:  # every local stage on its own input, one micro-batch each
            def fwd():
                outs = []
                for mod, s in zip(stage_mods, stage_ids):
                    x = mb if s == 0 else torch.randn(B, S_in, cfg["hidden_size"], dtype=_dtype(sc["precision"]),
                                                      requires_grad=True)
                    outs.append(loss_fn(mod(x), mb) if s == npp * v - 1 else mod(x).sum())
                return sum(outs)
        elif pp_rank == 0:
            fwd = lambda: stage_mod(mb)  # noqa: E731
        else:
            h = torch.randn(B, S_in, cfg["hidden_size"], dtype=_dtype(sc["precision"]), requires_grad=True)
            fwd = (lambda: loss_fn(stage_mod(h), mb)) if last else (lambda: stage_mod(h))
    else:
        fwd = lambda: net(ids, labels=ids).loss  # noqa: E731
    with loss_context():
        saved, out = saved_activations(model, fwd)
        if strategy in ("ddp", "fsdp", "fsdp1", "tp"):
            out.backward()  # collectives in backward must run on every rank
        del out
    opt.zero_grad(set_to_none=True)
    dist.barrier()

    if sc["profile_step"]:
        peaks = [baseline + _profiled_peak(step) for _ in range(3)]
        extra["profiled_peak_bytes"], extra["profiled_peaks_bytes"] = min(peaks), peaks  # see _profiled_peak
    if repeats := sc["tracked_repeats"] or (3 if sc["profile_step"] else 0):
        # gloo's worker thread may hold a finished collective's buffers a moment past the last Python
        # reference (ProcessGroupGloo.cpp runLoop; fp32 gathered logits: 3,588,580 B, once 3,785,188 B); that
        # only adds bytes, so the least of several tracked steps is the step's own peak
        extra["op_boundary_peaks_bytes"] = [_tracked_peak(new_tracker(), step) for _ in range(repeats)]

    return {
        "rank": rank, "world_size": world, "scenario": sc,
        "pp_stage": rank // (pp_dp * pp_tp) if strategy == "pp" else None,
        "activation_bytes": saved.total_bytes,
        "activation_items": sorted(saved.items, key=lambda i: -i["nbytes"]),
        "states_bytes": states,
        "gradient_logical_bytes": states_logical_gradient,
        "baseline_bytes": baseline,
        "peak_bytes": tracker.peak_bytes,
        "peak_op": tracker.peak_op,
        "peak_parts": tracker.peak_parts,
        "peak_other_sizes": tracker.peak_other_sizes,
        "marks": tracker.marks,
        "inflight_activation_bytes": tracker.peak_saved_bytes,
        "ddp_buckets_bytes": storage_bytes(buckets.values()),
        "pp_recv_buffers_bytes": storage_bytes(_pipeline_buffers(*stages)) if strategy == "pp" else 0,
        "state_items": grads_seen["items"],
        **extra,
    }


def _tracked_peak(tracker, step) -> int:
    with tracker:
        step()
    return tracker.peak_bytes


def _profiled_peak(step) -> int:
    """The most bytes one more step allocated above its start, from the CPU allocator's own
    events (torch.profiler with ``profile_memory``): unlike the op-boundary tracker it sees the
    temporaries made and freed inside one op (a DTensor handler such as loss_parallel's).

    A free made on gloo's worker thread is never recorded (``c10/core/Allocator.cpp``
    ``memoryProfilingEnabled`` reads the freeing thread's profiler state; docs/parallel.md, "TP
    collective buffers on gloo"), so this peak reads high by the collective buffers that thread
    freed, and varies from step to step by whole B·S·H buffers (bf16 SP, tiny Llama: 1,760,200 to
    1,874,888 B, in steps of 16,384 B). The caller keeps the least of three steps, still an upper
    bound, and every reading beside it."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    events = sorted((e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"),
                    key=lambda e: e.start_ns())
    cur = peak = 0
    for e in events:
        cur += e.nbytes()
        peak = max(peak, cur)
    return peak


def main(argv: list[str] | None = None) -> int:
    """``argv[0]``: a JSON object with ``out_dir`` and ``scenarios`` (a list), run in order in
    one process group (imports dominate a launch on a small CPU box); writes
    ``out_dir/rank<r>.json``, the list of this rank's results."""
    import gc

    import torch.distributed as dist

    argv = sys.argv[1:] if argv is None else argv
    payload = json.loads(argv[0])
    out_dir = Path(payload["out_dir"])
    dist.init_process_group("gloo")
    try:
        rank, world = dist.get_rank(), dist.get_world_size()
        results = []
        for scenario in payload["scenarios"]:
            results.append(run(scenario, rank, world))
            gc.collect()
        tmp = out_dir / f"rank{rank}.json.tmp"
        tmp.write_text(json.dumps(results, indent=1))
        os.replace(tmp, out_dir / f"rank{rank}.json")
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    from trainmem.measure_dist.leave import leave

    leave(main())
