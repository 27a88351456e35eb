"""Communication buffers of one pipeline stage, persistent for the whole step or per phase: DDP
gradient buckets, ZeRO bucket buffers, FSDP all-gather (current + prefetched block),
reduce-scatter and unsharded-root buffers (FSDP2 under pipelining, CPU offload's copies),
context-parallel ring backward or K/V all-gather buffers, and pipeline send/receive buffers. Called by
:func:`trainmem.estimate.parallel.rank_classes` once per stage with a :class:`_Rank`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from trainmem.estimate.context_parallel import buffer_copies_bytes, ring_buffers
from trainmem.estimate.float8 import gathered_bytes_per_element
from trainmem.estimate.fsdp import pp_unsharded_working
from trainmem.estimate.fsdp1_flat import fsdp1_grad_bytes, fsdp1_layout, fsdp1_working
from trainmem.estimate.fsdp_units import separate_unit, unit_gathered
from trainmem.estimate.fsdp_offload import cpu_offload, offload_working
from trainmem.inventory import Category, MemoryItem, dtype_bytes
from trainmem.names import is_token_embedding, layer_index
from trainmem.specs import ImplSpec, ModelSpec, ParallelSpec, StepSpec


_ZERO_BUCKET = 500_000_000  # DeepSpeed's reduce/allgather bucket default, in elements


_FWD_BWD = ("forward", "backward_start", "backward", "backward_end")


@dataclass(frozen=True, kw_only=True)
class _Rank:
    """What one pipeline stage's buffers depend on."""

    model: ModelSpec
    local: ModelSpec  # the TP-local model
    step: StepSpec
    local_step: StepSpec  # the CP-local sequence
    impl: ImplSpec
    par: ParallelSpec
    stage: int
    last: int  # the last stage's index
    zero: int  # 3 under FSDP
    group: int  # ranks sharing one copy of the sharded states
    stage_act_bytes: float = 0  # one micro-batch's activations on this stage (the interleaved timeline)
    timeline: object = None  # FSDP2's per-unit sizes where estimate/fsdp_timeline.py models the step


def _buffers(r: _Rank, stage_states: list[MemoryItem], states: list[MemoryItem],
             tp_div: dict[str, int]) -> tuple[dict[str, int], dict[str, dict[str, int]]]:
    """Communication buffers of stage ``r.stage``: (persistent for the whole step, per-phase working).
    ``stage_states``: the stage's model-state items; ``tp_div``: each state's TP/EP divisor."""
    model, lm, step, lstep, impl, par, zero, group = (r.model, r.local, r.step, r.local_step, r.impl, r.par,
                                                      r.zero, r.group)
    d = step.dtypes
    act_b = dtype_bytes(d.activation)
    persistent: dict[str, int] = {}
    working: dict[str, dict[str, int]] = {p: {} for p in _FWD_BWD}

    def every(name: str, value: int, phases=_FWD_BWD) -> None:
        for p in phases:
            working.setdefault(p, {})[name] = working.get(p, {}).get(name, 0) + int(value)

    stage_params = [i for i in stage_states if i.category is Category.PARAMETER]
    # gradient buffers hold only the gradients that exist (fine-tuning freezes parameters; its
    # adapters' gradients may be fp32 under a 16-bit base), each in its own dtype
    grad_bytes = {i.name.removesuffix(".grad"): i.bytes for i in states if i.category is Category.GRADIENT}
    if par.fsdp and par.fsdp_version == 1:  # the flat parameter's gradient covers its frozen parameters
        grad_bytes = fsdp1_grad_bytes(states)
    train_grad_bytes = sum(grad_bytes.get(i.name, 0) / tp_div[i.name] for i in stage_params)
    # FSDP2 all-gathers in MixedPrecisionPolicy.param_dtype: the gathered weights are the compute dtype
    gb, pb = dtype_bytes(d.grad), dtype_bytes(d.compute)

    from trainmem.estimate.fsdp_quant import NF4_DTYPE, quantized_gather_bytes
    nf4 = {i.name for i in stage_states if i.dtype == NF4_DTYPE}

    def gathered(i: MemoryItem) -> float:  # fp8 for Float8 linears under torchao's fp8 all-gather
        q = quantized_gather_bytes(i, nf4)  # a torchao NF4 weight gathers its own storages (estimate/fsdp_quant.py)
        return gathered_bytes_per_element(impl, model, i.name, i.shape, pb) if q is None else q
    if par.dp * par.cp > 1 and zero == 0:
        # torch DDP copies gradients into flat buckets (gradient_as_bucket_view=False);
        # Megatron's DDP keeps gradients in the contiguous buffer itself
        if impl.profile != "megatron":
            persistent["ddp_gradient_buckets"] = int(train_grad_bytes)
    elif zero in (1, 2):
        persistent["zero_buckets"] = int(2 * min(_ZERO_BUCKET * gb, train_grad_bytes))
    elif zero == 3 and par.fsdp_version == 1 and not cpu_offload(par):  # FlatParameters: estimate/fsdp1_flat.py
        flat_gb = (lambda u: pb) if d.gathered else (lambda u: dtype_bytes(u.dtype))  # FSDP1 MixedPrecision
        for ph, parts in fsdp1_working(fsdp1_layout(stage_states, group)[1], gathered_bytes=flat_gb, grad_bytes=gb,
                                       reshard_after_forward=par.reshard_after_forward).items():
            for k, v in parts.items():
                every(k, v, (ph,))
    elif zero == 3:
        per_layer: dict[int, float] = {}  # gathered bytes
        per_layer_grad: dict[int, float] = {}
        root = 0.0
        units = {"embed": 0.0, "head": 0.0}  # separate FSDP units (estimate/fsdp_units.py)
        unit_grads = dict(units)
        for i in stage_params:
            li = layer_index(i.name)
            numel = math.prod(i.shape) / tp_div[i.name]
            if li is not None:
                per_layer[li] = per_layer.get(li, 0) + numel * gathered(i)
                per_layer_grad[li] = per_layer_grad.get(li, 0) + grad_bytes.get(i.name, 0) / tp_div[i.name]
            elif (unit := separate_unit(i.name, par.fsdp_units)) is not None and par.fsdp_version == 2:
                units[unit] += numel * gathered(i)
                unit_grads[unit] += grad_bytes.get(i.name, 0) / tp_div[i.name]
            else:
                root += numel * gathered(i)
        big = max(per_layer.values(), default=0)
        big_grad = max(per_layer_grad.values(), default=0)
        if r.timeline is not None:  # each FSDP2 tensor at each phase: estimate/fsdp_timeline.py
            from trainmem.estimate.fsdp_timeline import working as timeline_working
            for ph, parts in timeline_working(r.timeline, reshard=par.reshard_after_forward).items():
                for k, v in parts.items():
                    every(k, v, (ph,))
        elif par.reshard_after_forward and par.fsdp_units != "blocks" and par.fsdp_version == 2:
            # the embedding and head units gathered around their own forward/backward only
            every("fsdp_root_unsharded", root)  # the whole root, beside its shard (below)
            for ph, v in unit_gathered(block=big, **units, tied=model.tied_embeddings).items():
                every("fsdp_allgather", v, (ph,))
            # each unit's unsharded gradients reduce-scattered after its own backward: the head's
            # first, the embedding's last
            every("fsdp_reduce_scatter", unit_grads["head"], ("backward_start",))
            every("fsdp_reduce_scatter", big_grad, ("backward",))
            every("fsdp_reduce_scatter", max(big_grad, unit_grads["embed"]), ("backward_end",))
        elif par.reshard_after_forward:
            # FSDP2 never reshards the root after forward; one block is gathered ahead of its
            # backward, two (current + prefetched) and a reduce-scatter during the blocks' backward.
            # The gathered root is whole beside its shard: FSDPParam.init_all_gather_outputs
            # (torch/distributed/fsdp/_fully_shard/_fsdp_param.py) allocates numel × world for
            # the all-gather output and init_unsharded_param views the parameter into it; the shard
            # (_sharded_param_data) is another storage (checked on gloo: tiny Llama root 131,328 B
            # gathered next to its 65,664 B shard, docs/parallel.md)
            every("fsdp_root_unsharded", root)
            every("fsdp_allgather", big, ("forward", "backward_start"))
            every("fsdp_allgather", 2 * big, ("backward",))
            every("fsdp_reduce_scatter", big_grad, ("backward", "backward_end"))
        else:
            # gathered parameters stay from forward to backward, next to their shards
            every("fsdp_unsharded_params", sum(math.prod(i.shape) / tp_div[i.name] * gathered(i) for i in stage_params))
            every("fsdp_reduce_scatter", big_grad, ("backward", "backward_end"))
        if cpu_offload(par):  # the shards' copies to and from the device: estimate/fsdp_offload.py
            for ph, parts in offload_working(stage_params, tp_div, grad_bytes, gathered, group, pb,
                                             par.fsdp_units, root_grads=r.timeline is None).items():
                for k, v in parts.items():
                    every(k, v, (ph,))
        if par.pp > 1 and impl.profile != "megatron":  # torch.distributed.pipelining: estimate/fsdp.py
            _pp_unsharded(working, stage_params, grad_bytes, tp_div, gathered, par.reshard_after_forward,
                          gpipe=par.schedule == "gpipe", rank=r)
    if par.cp > 1 and par.cp_style == "ring":
        # torch's ring runs inside each attention call: its backward's buffers, the worst rank's, a node moment of
        # each block's attention (estimate/context_parallel.py ring_as_node_moment); its forward's are gone by the
        # end of forward
        every("cp_ring_backward", max(ring_buffers(lm, lstep, par, act_b).backward), ("backward",))
        every("cp_buffer_copies", buffer_copies_bytes(batch=lstep.batch, seq=step.seq, cp=par.cp),
              (*_FWD_BWD, "backward_first_block"))
    elif par.cp > 1:
        kv = 2 * lstep.batch * lstep.seq * lm.num_kv_heads * lm.head_dim * act_b
        every("cp_kv_allgather", 2 * kv)
    if par.pp > 1:
        tokens = lstep.batch * lstep.seq // (par.tp if par.sp else 1)
        one = tokens * model.hidden_size * act_b
        if impl.profile == "megatron":  # Megatron's two receive buffers
            if r.stage > 0:
                every("pp_recv_activations", one)
            if r.stage < r.last:
                every("pp_recv_gradients", one)
        else:  # torch.distributed.pipelining: a receive buffer per micro-batch and local (virtual) stage
            _pp_stage_io(every, par, r.stage, one, tuple(working), r.stage_act_bytes)
    return persistent, working


def _pp_unsharded(working: dict[str, dict[str, int]], stage_params: list[MemoryItem], grad_bytes: dict[str, int],
                  tp_div: dict[str, int], gathered, reshard_after_forward: bool, *, gpipe: bool,
                  rank: _Rank | None = None) -> None:
    """FSDP2 under torch.distributed.pipelining (estimate/fsdp.py): no reduce-scatter until the
    last micro-batch's backward is done; unsharded gradients (and gathered blocks) kept until then."""
    block_grads: dict[int, float] = {}
    block_params: dict[int, float] = {}
    root = first = 0.0
    for i in stage_params:
        li = layer_index(i.name)
        g = grad_bytes.get(i.name, 0) / tp_div[i.name]
        if li is None:
            root += g
            first += g if is_token_embedding(i.name) else 0
        else:
            block_grads[li] = block_grads.get(li, 0) + g
            block_params[li] = block_params.get(li, 0) + math.prod(i.shape) / tp_div[i.name] * gathered(i)
    working["backward_first_block"] = dict(working["backward"])
    for ph in ("backward", "backward_first_block"):
        working[ph].pop("fsdp_reduce_scatter", None)
    tl = None
    if rank is not None and rank.par.schedule == "interleaved" and rank.par.virtual_stages > 1:
        tl = _interleaved_timeline(rank, block_grads, root - first, first)
    extra = pp_unsharded_working(block_grads=block_grads, root_grads=root, first_grads=first,
                                 block_params=block_params, gpipe=gpipe, reshard_after_forward=reshard_after_forward,
                                 timeline=tl)
    for ph, parts in extra.items():
        if "fsdp_pp_unsharded_params" in parts:
            working[ph].pop("fsdp_allgather", None)
        working[ph].update({k: int(v) for k, v in parts.items()})


def _interleaved_timeline(r: _Rank, block_grads: dict[int, float], head_grads: float, embed_grads: float):
    """The rank's interleaved 1F1B timeline (estimate/pp_schedule.py): its blocks split over its
    virtual stages (the embedding's gradients with the first, the head's with the last), each
    virtual stage's activations its share of the stage's by layers."""
    from trainmem.estimate.pp_schedule import rank_actions, timeline, virtual_split

    par = r.par
    v = par.virtual_stages
    layers = sorted(block_grads)
    sizes = virtual_split(len(layers), v, r.stage, par.pp)
    grads, start = [], 0
    for n in sizes:
        grads.append(sum(block_grads[li] for li in layers[start:start + n]))
        start += n
    grads[0] += embed_grads
    grads[-1] += head_grads
    held = [r.stage_act_bytes * n / max(1, len(layers)) for n in sizes]
    return timeline(rank_actions("interleaved", pp=par.pp, v=v, m=par.microbatches, rank=r.stage), held, grads)


def _pp_stage_io(every, par: ParallelSpec, rank: int, one: int, phases: tuple[str, ...], act_bytes: float) -> None:
    """torch.distributed.pipelining's stage I/O on pipeline rank ``rank`` (estimate/pp_schedule.py):
    ``_PipelineStageBase`` allocates one activation receive buffer per micro-batch for each local
    stage but the model's first and one gradient receive buffer per micro-batch for each but its
    last, kept across steps; and every forwarded micro-batch's stage output stays in
    ``fwd_cache`` until its backward. ``one``: one micro-batch's boundary activation; ``phases``:
    every working phase of the stage (the receive buffers live in all of them); ``act_bytes``: one
    micro-batch's activations on the stage. Outputs and sent input gradients: ``stage_io_held``."""
    from trainmem.estimate.pp_schedule import local_stages, stage_io_held

    v, m = par.virtual_stages, par.microbatches
    ids = local_stages(par.schedule, pp=par.pp, v=v, rank=rank)
    total = par.pp * len(ids)
    every("pp_recv_activations", m * one * sum(1 for g in ids if g > 0), phases)
    every("pp_recv_gradients", m * one * sum(1 for g in ids if g < total - 1), phases)
    # stage outputs and sent input gradients at the worst forward, backward and after the last backward
    io = stage_io_held(par.schedule, pp=par.pp, v=v, m=m, rank=rank, held=[act_bytes / len(ids)] * len(ids),
                       one=one)
    for key, at in (("forward", ("forward",)), ("backward", ("backward_start", "backward", "backward_first_block")),
                    ("end", ("backward_end",))):
        for name, n in zip(("pp_stage_outputs", "pp_sent_input_grads"), io[key]):
            if n:
                every(name, one * n, tuple(p for p in at if p in phases))
