"""Memory per rank under data, tensor, sequence, context, expert and pipeline parallelism,
ZeRO/FSDP and offload.

Every rank class (one per pipeline stage) gets its own inventory and phases:

* **activations** come from the same block rules run on the rank-local model (heads, FFN width
  and vocabulary divided by ``tp``; sequence divided by ``cp``; sequence parallelism splitting
  the norm/residual/dropout tensors), cut by pipeline stage according to which layer *keeps*
  each tensor, and multiplied by the micro-batches the schedule holds in flight;
* **model states** are the single-device items, each divided by how it is sharded: tensor
  parallel weights by ``tp`` (column/row-parallel projections, vocab-parallel embedding and
  head), experts by ``ep``, then ZeRO/FSDP over the data-parallel group (stage 1: optimizer
  states and master weights, 2: + gradients, 3 / FSDP: + parameters);
* **buffers**: DDP gradient buckets, ZeRO bucket buffers, FSDP all-gather (current + prefetched
  block) and reduce-scatter buffers, context-parallel K/V ring buffers, pipeline send/receive.

Known limitations: pipeline stages are modelled in steady state (the schedule's in-flight
micro-batches), with shared tensors such as RoPE tables counted once on the first stage that
keeps them; expert parallelism assumes balanced routing; DeepSpeed bucket sizes are its
defaults (5e8 elements).

This module is the driver (:func:`rank_classes`, with :func:`validate` and the memoized
activations and states); the steps live apart: pipeline stages in ``parallel_pp``, ZeRO/FSDP
sharding and offload in ``parallel_zero``, the TP/CP-local model and TP divisors in
``parallel_tp``, the communication buffers in ``parallel_buffers``, a stage's phases (GPipe's
later micro-batch included) in ``parallel_phases``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from functools import lru_cache

from trainmem.errors import SpecError, UnsupportedError
from trainmem.estimate.activations import activation_items_with_savers
from trainmem.estimate.attention import kernel_for
from trainmem.estimate.autocast_cache import (
    bias_copies, check_schedule_autocast, deferred_cast_grads, schedule_caches_casts, stage_copies, with_cache,
    without_weight_casts,
)
from trainmem.estimate.buffers import buffer_items, stage_buffers
from trainmem.estimate.compiled_op_moment import recomputes_blocks
from trainmem.estimate.compiled_sharded import check_compiled_parallel
from trainmem.estimate.context_parallel import ring_as_node_moment
from trainmem.estimate.compiled_3d import check_compiled_tp_layout
from trainmem.estimate.ctx import Shard
from trainmem.estimate.finetune import dequant_transient, head_dequant, with_dequant_transient
from trainmem.estimate.fsdp1_flat import autograd_finetune, fsdp1_states
from trainmem.estimate import fsdp_timeline as ft
from trainmem.estimate.compiled_float8_op import fp8_gathered
from trainmem.estimate.fsdp_offload import (
    composes_with_activation_offload, cpu_offload, offload_node_moments, offload_states, rank_activation_offload,
)
from trainmem.estimate.heads import logits_width
from trainmem.estimate import loss_parallel as lp
from trainmem.estimate.model_states import model_state_items, optimizer_transient
from trainmem.estimate.parallel_buffers import _buffers, _Rank
from trainmem.estimate.parallel_phases import StageInputs, stage_phases
from trainmem.estimate.parallel_pp import (
    _stage_of, apply_pp, in_flight, output_chunk_aliases, recv_input_aliases, stage_layers, stage_node_moments,
    caller_batch, fsdp_stage_moments,
)
from trainmem.estimate.parallel_tp import _tp_factor, apply_cp, apply_tp, tp_node_moments
from trainmem.estimate.parallel_zero import apply_offload, apply_zero, shard_group
from trainmem.estimate.every_k_stages import check_every_k_stages, place_every_k
from trainmem.estimate.peak import Phase, PhasedResult, recompute_per_layer
from trainmem.families import output_modules
from trainmem.inventory import Category, Inventory, MemoryItem, dtype_bytes
from trainmem.names import as_block, is_token_embedding, layer_index
from trainmem.specs import ImplSpec, ModelSpec, ParallelSpec, StepSpec

__all__ = ["RankClass", "rank_classes", "validate"]


@dataclass(frozen=True)
class RankClass(PhasedResult):
    """Ranks that hold the same bytes: one pipeline stage across its DP × TP × CP ranks."""

    name: str
    count: int
    layers: tuple[int, int]
    inventory: Inventory
    phases: tuple[Phase, ...]
    host_bytes: int
    in_flight: int


    def to_dict(self) -> dict:
        return {
            "name": self.name, "count": self.count, "layers": list(self.layers),
            "totals_bytes": self.totals_bytes, "peak_bytes": self.peak_bytes,
            "peak_phase": self.peak.name, "host_bytes": self.host_bytes,
            "in_flight_microbatches": self.in_flight,
            "phases": [p.to_dict() for p in self.phases],
        }


# --- validation and layout --------------------------------------------------------------------

def validate(model: ModelSpec, step: StepSpec, impl: ImplSpec, par: ParallelSpec) -> None:
    """Refuse combinations that cannot run, naming every degree involved."""
    degrees = (f"dp={par.dp} tp={par.tp} cp={par.cp} pp={par.pp} ep={par.ep} "
               f"(heads={model.num_heads}, kv_heads={model.num_kv_heads}, layers={model.num_layers}, "
               f"seq={step.seq})")
    if model.num_heads % par.tp or model.num_kv_heads % par.tp:
        raise SpecError("tp", par.tp, f"must divide num_heads and num_kv_heads: {degrees}")
    if model.ffn_size % par.tp:
        raise SpecError("tp", par.tp, f"must divide ffn_size={model.ffn_size}: {degrees}")
    if par.pp > model.num_layers:
        raise SpecError("pp", par.pp, f"exceeds the model's layers: {degrees}")
    if par.layer_split:
        if len(par.layer_split) != par.pp or sum(par.layer_split) != model.num_layers or min(par.layer_split) < 1:
            raise SpecError("layer_split", par.layer_split,
                            f"needs pp={par.pp} positive entries summing to {model.num_layers} layers")
    # an explicit --layer-split gives each rank's layers over all its virtual stages (torchtitan's
    # generate_split_points splits unevenly: 126 layers over 16 stages as 7, 8 x 14, 7)
    if par.schedule == "interleaved" and not par.layer_split and model.num_layers % (par.pp * par.virtual_stages):
        raise SpecError("virtual_stages", par.virtual_stages,
                        f"pp × virtual_stages must divide the layers: {degrees}")
    check_every_k_stages(model, impl, par)  # torchtitan counts each rank's own blocks (estimate/every_k_stages.py)
    if step.seq % par.cp:
        raise SpecError("cp", par.cp, f"must divide seq: {degrees}")
    if par.sp and (step.seq // par.cp) % par.tp:
        raise SpecError("sp", True, f"sequence parallelism needs tp to divide seq/cp: {degrees}")
    if par.ep > 1:
        if not model.is_moe:
            raise SpecError("ep", par.ep, "expert parallelism needs a mixture-of-experts model")
        if model.num_experts % par.ep or (par.dp * par.cp) % par.ep:
            raise SpecError("ep", par.ep, f"must divide num_experts={model.num_experts} and dp×cp: {degrees}")
        if impl.routing != "balanced":  # the hot experts' ranks would receive more tokens than their share
            raise SpecError("routing", impl.routing, f"is not modelled with ep={par.ep}: the estimate gives every "
                            "expert-parallel rank its balanced share of tokens")
    if par.cp > 1 and impl.attention in ("eager", "sdpa-math"):
        raise SpecError("cp", par.cp, f"context parallelism needs a fused attention kernel, not {impl.attention}")
    if par.fsdp == "hybrid" and (par.dp * par.cp) % min(par.fsdp_group, par.dp * par.cp):
        raise SpecError("fsdp_group", par.fsdp_group, f"must divide the data-parallel ranks dp×cp: {degrees}")
    if par.zero and par.fsdp:
        raise SpecError("zero", par.zero, f"choose ZeRO or FSDP, not both (fsdp={par.fsdp})")
    if "params" in par.offload and not (par.zero == 3 or par.fsdp):
        raise SpecError("offload", "params", "parameter offload needs ZeRO-3 or FSDP")
    if par.fsdp_version == 1 and (par.tp > 1 or par.ep > 1 or par.pp > 1):  # estimate/fsdp1_flat.py: one flat shard
        raise SpecError("fsdp_version", 1, f"FSDP1 is modelled with data parallelism only, not with {degrees}")
    check_schedule_autocast(model, step, impl, par)  # the schedule's cast cache: estimate/autocast_cache.py
    lp.check(impl.profile, par)
    check_compiled_parallel(impl, par, step.recipe)  # compile under FSDP2 only (estimate/compiled_sharded.py)
    check_compiled_tp_layout(impl, par)  # compile under TP, + FSDP2 and/or PP (estimate/compiled_3d.py)
    if impl.float8 != "none" and par.tp > 1 and (step.recipe not in ("fp32", "bf16", "fp16", "fsdp-bf16") or (
            impl.float8 == "tensorwise" and (not par.sp or impl.recompute not in ("none", "full")))):
        # estimate/float8.py _tp_fp8_input: torchao's Float8 TP styles as torchtitan applies them (with SP)
        raise SpecError("float8", impl.float8, f"with tp={par.tp} is modelled in pure precisions (fp32, bf16, "
                        f"fsdp-bf16; precision={step.recipe!r}), tensorwise with sequence parallelism (sp=True, "
                        f"torchtitan's plan; sp={par.sp}) and recompute none or full (recompute={impl.recompute!r})")


# --- the pipeline: pure steps over an inventory ------------------------------------------------
#
# rank_classes composes them: apply_tp (the TP-local model: heads, FFN, vocabulary ÷ tp) and
# apply_cp (the CP-local sequence) shape what the activation rules produce (_layout); per stage,
# apply_pp keeps the stage's items, apply_zero divides each model state by its TP/EP divisor and,
# by ZeRO stage, by the sharding group, apply_offload moves offloaded states to host (_stage_items);
# the communication buffers (_stage_working) and the phases (estimate/parallel_phases.py) follow.

@dataclass(frozen=True)
class _Layout:
    """What every stage of one layout shares: the rank-local model and step, the activations and model
    states with the stage keeping each, the sharding group. ``traced``: ``--profile traced``'s parts."""

    model: ModelSpec
    step: StepSpec
    impl: ImplSpec
    par: ParallelSpec
    finetune: object
    stages: tuple[tuple[int, int], ...]
    lm: ModelSpec  # the TP-local model
    lstep: StepSpec  # the CP-local step
    loss_lm: ModelSpec  # the model whose logits the loss reads (estimate/loss_parallel.py)
    acts: tuple
    act_stage: tuple
    recompute_all: dict
    states: tuple
    state_stage: dict
    tp_div: dict
    traced: tuple | None
    cached: bool  # the schedule's autocast caches the weight copies (estimate/autocast_cache.py)
    zero: int
    group: int
    shard: Shard
    bufs: tuple

    @property
    def last(self) -> int:
        return len(self.stages) - 1

    @property
    def torch_engine(self) -> bool:  # DTensor / FSDP2 / torch.distributed.pipelining
        return self.impl.profile != "megatron"


def rank_classes(model: ModelSpec, step: StepSpec, impl: ImplSpec, par: ParallelSpec,
                 finetune=None) -> list[RankClass]:
    impl = place_every_k(model, impl, par)  # every-k: each pipeline rank counts its own blocks (every_k_stages.py)
    validate(model, step, impl, par)
    check_schedule_autocast(model, step, impl, par, finetune)
    if impl.profile == "megatron" and par.cp > 1:
        raise UnsupportedError("the megatron profile models tensor/sequence parallelism, not context parallelism")
    lay = _layout(model, step, impl, par, finetune)
    return [_rank_class(lay, s) for s in range(len(lay.stages))]


def _layout(model: ModelSpec, step: StepSpec, impl: ImplSpec, par: ParallelSpec, finetune) -> _Layout:
    stages = tuple(stage_layers(model, par))
    lm, lstep = apply_tp(model, par), apply_cp(step, par)
    shard = Shard(tp=par.tp, sp=par.sp, cp=par.cp, cp_style=par.cp_style, ep=par.ep)
    traced = None
    cached = schedule_caches_casts(pp=par.pp, autocast=step.dtypes.autocast, torch_engine=impl.profile != "megatron")
    if impl.profile == "traced":  # estimate/traced/tp.py: read off a trace at one TP rank's shapes (--tp alone)
        from trainmem.estimate.traced import traced_rank_parts
        traced = traced_rank_parts(model, step, impl, par)
        acts, act_stage, recompute_all = traced[0]
    else:
        acts, act_stage, recompute_all = _local_activations(lm, lstep, impl, finetune, shard, stages, cached)
    loss_lm = lp.loss_model(model, lm, par)  # TP without loss_parallel: the loss reads full-vocabulary logits
    if loss_lm is not lm and traced is None:
        acts = lp.with_loss_items(acts, _local_activations(loss_lm, lstep, impl, finetune, shard, stages, cached)[0],
                                  output_modules())
    # model states do not depend on the micro-batch or accumulation (estimate/model_states.py)
    states, state_stage, tp_div = traced[1] if traced else _local_states(
        model, replace(step, batch=1, grad_accum=1), finetune, par.tp, par.ep, par.pp, stages, impl.profile)
    group = shard_group(par)
    if par.fsdp and par.fsdp_version == 1 and traced is None:  # FSDP1: what autograd sees (estimate/fsdp1_flat.py)
        act_ft = autograd_finetune(finetune, states, group)
        if act_ft is not finetune:  # frozen weights in a trainable flat parameter save their inputs
            acts, act_stage, recompute_all = _local_activations(lm, lstep, impl, act_ft, shard, stages, cached)
    return _Layout(model=model, step=step, impl=impl, par=par, finetune=finetune, stages=stages, lm=lm, lstep=lstep,
                   loss_lm=loss_lm, acts=acts, act_stage=act_stage, recompute_all=recompute_all, states=states,
                   state_stage=state_stage, tp_div=tp_div, traced=traced, cached=cached,
                   zero=3 if par.fsdp else par.zero, group=group, shard=shard,
                   bufs=buffer_items(model, step, impl.profile))


def _rank_class(lay: _Layout, s: int) -> RankClass:
    """One stage's rank class: its items, its buffers, its phases."""
    par, d = lay.par, lay.step.dtypes
    a, b = lay.stages[s]
    n = in_flight(par, s)
    stage_acts, head_acts = _stage_activations(lay, s)
    items, host, body, act_off = _stage_items(lay, s, stage_acts, head_acts, n)
    own_states = [i for i in lay.states if lay.state_stage[i.name] == s]
    tl = (ft.units(own_states, world=lay.group, param_bytes=dtype_bytes(d.compute), grad_bytes=dtype_bytes(d.grad),
                   offload=cpu_offload(par), fp8_gathered=fp8_gathered(lay.model, lay.impl))
          if ft.applies(par, lay.step, lay.impl, lay.finetune) else None)  # FSDP2 per tensor: estimate/fsdp_timeline.py
    persistent, working = _stage_working(lay, s, stage_acts, own_states, body, tl, act_off)
    inputs = _stage_inputs(lay, s, items, stage_acts, own_states, body, tl, act_off, persistent, working)
    ph = _rank_extras(lay, s, stage_phases(inputs, items), stage_acts)
    inv = Inventory(tuple(items) + tuple(
        MemoryItem.make(f"buffers.{k}", Category.BUFFER, (), d.activation, v, "communication buffer")
        for k, v in {**persistent, **_largest_each(working)}.items() if v))
    return RankClass("rank" if par.pp == 1 else f"pp_stage_{s}", par.dp * par.tp * par.cp, (a, b), inv, tuple(ph),
                     host, int(math.ceil(n)))


def _stage_activations(lay: _Layout, s: int) -> tuple[list[MemoryItem], list[MemoryItem]]:
    """The activations stage ``s`` keeps, and those of them its output layer, loss and task heads keep."""
    par, impl = lay.par, lay.impl
    stage_acts = apply_pp(lay.acts, lay.act_stage, s)
    if s > 0 and lay.torch_engine:  # the received input is the receive buffer (estimate/parallel_pp.py)
        stage_acts = recv_input_aliases(stage_acts, lay.stages[s][0])
    if s == lay.last and par.pp > 1 and lay.torch_engine and impl.compile and impl.compile_scope == "block-loss":
        stage_acts = output_chunk_aliases(stage_acts)  # the compiled loss's saved logits: the output chunk
    outputs = output_modules()
    head_acts = [it for it in stage_acts if it.name.split(".")[0] in outputs]  # the output layer, loss, task heads
    if s > 0 and par.pp > 1:  # every stage computes its own RoPE tables
        stage_acts = stage_acts + [MemoryItem.make(f"stage{s}.{it.name}", it.category, it.shape, it.dtype,
                                                   it.bytes, it.formula, it.dims)
                                   for it in lay.acts if ".rotary_emb." in it.name or _own_position_ids(it.name)]
    return stage_acts, head_acts


def _own_position_ids(name: str) -> bool:
    """The position ids a stage's base-model forward builds for itself (``cache_position.unsqueeze(0)``), which its
    checkpointed blocks keep as a keyword input (``model.position_ids``, 1 x S int64 per micro-batch)."""
    return name.endswith(".position_ids") and layer_index(name) is None


def _stage_items(lay: _Layout, s: int, stage_acts: list, head_acts: list, n: float):
    """The stage's device items (sharded model states, its buffers, its activations times the micro-batches
    in flight, less what is offloaded), its host bytes, one micro-batch's activations (``body``) and activation
    offload's parts (estimate/fsdp_offload.py ``rank_activation_offload``; empty without it)."""
    par, d = lay.par, lay.step.dtypes
    a, b = lay.stages[s]
    stage_states = apply_pp(lay.states, [lay.state_stage[it.name] for it in lay.states], s)
    divisors = {it.name: lay.tp_div[it.name] for it in stage_states}
    emb_grad = f"{_embedding_name(lay.states)}.grad"
    if lay.torch_engine and not par.fsdp and emb_grad in divisors and divisors[emb_grad] % par.tp == 0:
        # DTensor gives the vocab-parallel embedding a replicated gradient; FSDP2 reduce-scatters it into
        # the sharded parameter's layout (its TP-local rows ÷ dp: trace/parallel_2d.py)
        divisors[emb_grad] //= par.tp
    sharded = (fsdp1_states(stage_states, world=lay.group) if par.fsdp and par.fsdp_version == 1
               else apply_zero(stage_states, divisors, zero=lay.zero, group=lay.group))
    # FSDP's CPU offload (estimate/fsdp_offload.py) keeps every sharded model state on the host
    items, host = offload_states(sharded) if cpu_offload(par) else apply_offload(sharded, par.offload)
    items = items + stage_buffers(lay.bufs, s, a, b)  # the model's buffers on this stage (estimate/buffers.py)
    # GPipe runs every forward before any backward: the loss's tensors are held per micro-batch too
    many = [] if par.schedule != "gpipe" else head_acts
    body = sum(it.bytes for it in stage_acts if it not in head_acts or it in many)
    act_off = None
    if composes_with_activation_offload(lay.impl, par):  # each rank as one device: estimate/fsdp_offload.py
        kept, moved, *act_off = rank_activation_offload(lay.lm, lay.lstep, lay.impl, stage_acts,
                                                         _stage_recompute(lay, s), lay.finetune)
        items += kept
        host += moved
    elif "activations" in par.offload:
        # everything but the block being computed and the one prefetched goes to host
        per_layer = body / max(1, b - a)
        keep = int(min(body, 2 * per_layer))
        host += int(body * n) - keep
        items += [it for it in stage_acts if it in head_acts]
        items.append(MemoryItem.make(f"stage{s}.activations_on_device", Category.ACTIVATION, (), d.activation,
                                     keep, "2 blocks' activations (the rest offloaded)"))
    else:
        items += stage_acts
        extra = int(round(body * (n - 1)))
        if extra:
            items.append(MemoryItem.make("pipeline.in_flight_microbatches", Category.ACTIVATION, (),
                                         d.activation, extra, f"({n:g} − 1) × stage activations"))
    return items, host, body, act_off


def _stage_recompute(lay: _Layout, s: int) -> dict:
    a, b = lay.stages[s]
    return {li: v for li, v in lay.recompute_all.items() if a <= li < b}


def _stage_working(lay: _Layout, s: int, stage_acts: list, own_states: list, body: int, tl, act_off):
    """The stage's communication buffers: persistent ones (all step) and working ones per phase
    (estimate/parallel_buffers.py), with the pipeline's own and activation offload's in-flight buffers."""
    par, lstep = lay.par, lay.lstep
    persistent, working = _buffers(_Rank(model=lay.model, local=lay.lm, step=lay.step, local_step=lstep,
                                         impl=lay.impl, par=par, stage=s, last=lay.last, zero=lay.zero,
                                         group=lay.group, stage_act_bytes=body, timeline=tl),
                                   own_states, lay.states, lay.tp_div)
    if par.pp > 1 and lay.torch_engine:  # the first block's backward holds the stage's buffers too (receive buffers...)
        working.setdefault("backward_first_block", dict(working.get("backward", {})))
        for parts in working.values():  # the caller's batch and the schedule's losses: estimate/parallel_pp.py
            parts.update(caller_batch(par, s, stage_acts, batch=lstep.batch, seq=lstep.seq))
    if lay.torch_engine and par.pp > 1 and s == lay.last:
        # torch.distributed.pipelining keeps every micro-batch's output until step() returns
        d = lay.step.dtypes
        lb = dtype_bytes(d.activation if d.autocast else d.compute)
        working["forward"]["pp_output_chunks"] = int(par.microbatches * lstep.batch * lstep.seq
                                                     * lay.loss_lm.vocab_size * lb)
        for ph_name in working:
            working[ph_name]["pp_output_chunks"] = working["forward"]["pp_output_chunks"]
    if lay.cached:  # one weight copy each for the step (estimate/autocast_cache.py)
        d = lay.step.dtypes
        with_cache(working, sum(b for _, b in _stage_copies(lay, s)),
                   compute_bytes=dtype_bytes(d.compute), activation_bytes=dtype_bytes(d.activation))
    if act_off:  # activation offload's stash and in-flight buffers, each block's largest tensor kept
        for ph, parts in act_off[1].items():
            working.setdefault(ph, {}).update(parts)
    return persistent, working


def _stage_inputs(lay: _Layout, s: int, items: list, stage_acts: list, own_states: list, body: int, tl,
                  act_off, persistent: dict, working: dict) -> StageInputs:
    """What the stage's phases are computed from (estimate/parallel_phases.py)."""
    model, step, impl, par, lm, lstep = lay.model, lay.step, lay.impl, lay.par, lay.lm, lay.lstep
    d = step.dtypes
    state_bytes = sum(i.bytes for i in items if i.category is Category.OPTIMIZER_STATE)
    full_state = sum(i.bytes for i in lay.states if i.category is Category.OPTIMIZER_STATE)
    tb, rule = lay.traced[2] if lay.traced else optimizer_transient(model, step, lay.states, lay.finetune, impl)
    if "optimizer" in par.offload or cpu_offload(par):
        tb, rule = 0, "optimizer step runs on the host (offloaded)"
    elif full_state:  # the optimizer's temporaries scale with this rank's optimizer states
        tb = int(tb * state_bytes / full_state)
    lsm = next((i for i in stage_acts if i.name == "loss.log_softmax"), None)
    torch_engine = lay.torch_engine
    fsdp_pp = fsdp_stage_moments(par, impl) if torch_engine else 0  # FSDP2 per stage's node moments: parallel_pp.py
    moments = (tl is not None or (torch_engine and stage_node_moments(par)) or bool(fsdp_pp)  # parallel_pp.py
               or offload_node_moments(impl, par)  # checkpointed blocks under CPU offload: estimate/fsdp_offload.py
               or (torch_engine and tp_node_moments(par, impl)))  # a TP rank's checkpointed blocks: parallel_tp.py
    # CP's ring backward: a node moment of each block's attention (estimate/context_parallel.py)
    ring = ring_as_node_moment(working, lm, lstep, par, dtype_bytes(d.activation),
                               taken=lay.traced is None and not act_off and not impl.optimizer_in_backward
                               and impl.recompute in ("none", "full"))  # as measured; else on the generic moment
    moments = moments or bool(ring)
    accumulated = max(step.grad_accum, par.microbatches)
    return StageInputs(
        par=par, batch=lstep.batch, seq=lstep.seq, vocab=logits_width(lay.loss_lm),
        logits_dtype=d.activation if d.autocast else d.compute,
        loss_dtype=lsm.dtype if lsm else "float32", loss=step.loss if s == lay.last else "none",
        # GPipe's first backward (and FSDP2 under PP) sees only its own gradients: estimate/fsdp.py
        grad_accum=(step.grad_accum if (par.schedule == "gpipe" or (torch_engine and lay.zero == 3)) and par.pp > 1
                    else accumulated),
        accumulated=accumulated, body=body,
        recompute=act_off[0] if act_off else _stage_recompute(lay, s),
        optimizer_transient=(tb, rule),
        attention_kernel=kernel_for(lm, lstep, impl),  # PhaseInputs.attention_kernel, as on one device
        residual_bytes=int(lstep.batch * lstep.seq * model.hidden_size * dtype_bytes(d.compute)
                           // (par.tp if par.sp else 1)),
        persistent=persistent, node_moments=moments,
        # FSDP2 per tensor: the loss's forward extras too (padded labels...: estimate/forward_held.py), not buffers
        # (and beside CP's ring, checked there: tests/parallel/test_cp_ring_backward.py)
        working=working if tl is None and ring is None else {**working, "forward": {
            **working.get("forward", {}), **_held(lm, lstep, impl, own_states, lay.finetune)}},
        grad_received=moments and s != lay.last,  # the stage's output gradient: pp_recv_gradients
        logits_held=torch_engine and par.pp > 1 and s == lay.last,  # the schedule's output chunks (pp_output_chunks)
        # FSDP2 per tensor or a pipeline stage, --recompute full: a checkpointed block's node moments run on
        # its recomputed tensors, as on one device (estimate/__init__.py; estimate/block_backward.py)
        recomputed=(Inventory(lay.traced[3] if lay.traced else _plain_activations(lm, lstep, impl, lay.finetune,
                                                                                   lay.shard, lay.cached))
                    if moments and recomputes_blocks(impl) and not act_off else None),
        tied_head=tl is not None and model.tied_embeddings and model.head not in ("seq-cls", "token-cls"),
        fsdp_pp_grads=fsdp_pp, ring=ring, timeline=tl, own_states=tuple(own_states), param_bytes=dtype_bytes(d.compute),
        deferred=_deferred(lay, s),  # a later micro-batch's weight-copy gradients (estimate/autocast_cache.py)
        # FSDP2: the middle blocks' moments (prefetch and reduce-scatter input at once: estimate/fsdp_timeline.py)
        middle_blocks=ft.middle_blocks(tl, reshard=par.reshard_after_forward) if tl is not None else None,
        block_math=ft.block_moments(lm, impl, lay.finetune) if tl is not None else None,  # a compiled block's moments
    )


def _deferred(lay: _Layout, s: int) -> dict[str, int]:
    """A later micro-batch's weight-copy gradients under the schedule's autocast (estimate/autocast_cache.py)."""
    if not lay.cached or lay.par.microbatches < 2:
        return {}
    return deferred_cast_grads(_stage_copies(lay, s), *lay.stages[s])


def _stage_copies(lay: _Layout, s: int) -> list[tuple[str, int]]:
    """Stage ``s``'s weight and bias copies in the schedule's cast cache (estimate/autocast_cache.py)."""
    plain = _plain_activations(lay.lm, lay.lstep, lay.impl, lay.finetune, lay.shard)
    own = [i for i in lay.states if lay.state_stage[i.name] == s]
    return stage_copies(plain, [_stage_of(i.name, list(lay.stages)) for i in plain], s,
                        bias_copies(own, dtype_bytes(lay.step.dtypes.activation)))


def _rank_extras(lay: _Layout, s: int, ph: list, stage_acts: list) -> list:
    """The last stage's loss under TP (estimate/loss_parallel.py) and QLoRA's dequantized weight beside the phases."""
    par, lstep, d = lay.par, lay.lstep, lay.step.dtypes
    if par.tp > 1 and lay.torch_engine and s == lay.last and lay.step.loss == "ce":  # estimate/loss_parallel.py
        lsm = next((i for i in stage_acts if i.name == "loss.log_softmax"), None)
        if lp.gathered_logits(par):
            ph = [*ph, lp.gather_phase(next(p for p in ph if p.name == "forward"), B=lstep.batch, S=lstep.seq,
                                       vocab=logits_width(lay.loss_lm), tp=par.tp,
                                       logits_dtype=d.activation if d.autocast else d.compute,
                                       loss_act=sum(i.bytes for i in stage_acts if i.name.startswith("loss.")))]
        else:
            ph = lp.sharded_loss_phases(ph, B=lstep.batch, S=lstep.seq, local_vocab=logits_width(lay.lm),
                                        loss_dtype=lsm.dtype if lsm else "float32")
    if lay.finetune is not None:  # QLoRA: this rank dequantizes its own (TP-local) largest 4-bit weight
        ph = with_dequant_transient(ph, *dequant_transient(lay.lm, lay.finetune, lay.impl.compile),
                                    *(head_dequant(lay.lm, lstep, lay.finetune) if s == lay.last else (0, 0)))
    return ph


# The two expensive, layout-independent parts are memoized (the planner evaluates many layouts
# that share them): the rank-local activations with the stage keeping each and the recompute per
# block, for one (local model, local step, impl, shard, stages); the model states with each one's
# stage and TP/EP divisor, for one (model, dtypes, optimizer, tp, ep, stages). Results are tuples
# and frozen items, never mutated.

def clear_caches() -> None:
    """Forget the memoized activations and states (benchmarks time cold runs with it)."""
    for f in (_local_activations, _plain_activations, _states, _local_states, _state_stages, _tp_divisors, _tp_factor):
        f.cache_clear()


@lru_cache(maxsize=64)
def _local_activations(lm: ModelSpec, lstep: StepSpec, impl: ImplSpec, finetune, shard: Shard,
                       stages: tuple[tuple[int, int], ...], cached: bool = False):
    acts, savers = activation_items_with_savers(lm, lstep, impl, finetune, shard)
    acts = without_weight_casts(acts) if cached else acts  # the schedule's cast cache: estimate/autocast_cache.py
    plain = _plain_activations(lm, lstep, impl, finetune, shard, cached) if impl.recompute != "none" else acts
    act_stage = tuple(_stage_of(sv, list(stages)) for sv in savers)
    return tuple(acts), act_stage, recompute_per_layer(Inventory(acts), Inventory(plain))


@lru_cache(maxsize=64)
def _plain_activations(lm: ModelSpec, lstep: StepSpec, impl: ImplSpec, finetune, shard: Shard,
                       cached: bool = False) -> tuple:
    """What the rank's blocks would save without checkpointing: what a checkpointed block recomputes (``cached``:
    its weight copies are the schedule's cast cache's, estimate/autocast_cache.py)."""
    plain_impl = replace(impl, recompute="none", recompute_every=1)
    if impl.compile and finetune is not None:  # a fully recomputed compiled block recomputes the eager
        plain_impl = replace(plain_impl, compile=False, compile_scope="model")  # block's set, as estimate()
    plain = activation_items_with_savers(lm, lstep, plain_impl, finetune, shard, kv_cache=False)[0]
    return without_weight_casts(plain) if cached else tuple(plain)


@lru_cache(maxsize=16)
def _states(model: ModelSpec, step: StepSpec, finetune, tied_copy: bool, profile: str) -> tuple[MemoryItem, ...]:
    states = model_state_items(model, step, finetune, profile)
    if tied_copy:  # the last stage keeps its own copy of the tied head
        states = states + [replace(i, name=i.name.replace(_embedding_name(states), "lm_head.weight", 1))
                           for i in states if i.name.startswith(_embedding_name(states))]
    return tuple(states)


@lru_cache(maxsize=64)
def _local_states(model: ModelSpec, step: StepSpec, finetune, tp: int, ep: int, pp: int,
                  stages: tuple[tuple[int, int], ...], profile: str = "hf"):
    states = _states(model, step, finetune, model.tied_embeddings and pp > 1, profile)
    state_stage = _state_stages(states, stages)
    tp_div = _tp_divisors(states, tp, ep)
    return states, state_stage, tp_div


@lru_cache(maxsize=64)
def _state_stages(states: tuple[MemoryItem, ...], stages: tuple[tuple[int, int], ...]) -> dict[str, int]:
    return {it.name: _stage_of(it.name, list(stages)) for it in states}


@lru_cache(maxsize=64)
def _tp_divisors(states: tuple[MemoryItem, ...], tp: int, ep: int) -> dict[str, int]:
    # every block's names are block 0's with another index: one _tp_factor call per distinct name
    return {it.name: _tp_factor(as_block(it.name), tp=tp, ep=ep) for it in states}


def _embedding_name(states: list[MemoryItem]) -> str:
    for it in states:
        if it.category is Category.PARAMETER and is_token_embedding(it.name):
            return it.name
    return "\0"


def _held(model, step, impl, states, finetune) -> dict[str, int]:
    """The loss's forward extras of this rank (the local batch; ``states``: the unsharded model states)."""
    from trainmem.estimate.forward_held import forward_held
    return forward_held(model, step, impl, Inventory(states), finetune)


def _largest_each(working: dict[str, dict[str, int]]) -> dict[str, int]:
    out: dict[str, int] = {}
    for parts in working.values():
        for k, v in parts.items():
            out[k] = max(out.get(k, 0), v)
    return out
