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
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from functools import lru_cache

from trainmem.errors import SpecError, UnsupportedError
from trainmem.estimate.activations import activation_items_with_savers
from trainmem.estimate.buffers import buffer_items, stage_buffers
from trainmem.estimate.ctx import Shard
from trainmem.estimate.finetune import dequant_transient, head_dequant, with_dequant_transient
from trainmem.estimate.float8 import gathered_bytes_per_element
from trainmem.estimate.fsdp import fsdp1_grad_bytes, fsdp1_states, pp_unsharded_working
from trainmem.estimate.fsdp_units import separate_unit, unit_gathered
from trainmem.estimate.fsdp_offload import (
    composes_with_activation_offload, cpu_offload, offload_states, offload_working, rank_activation_offload,
)
from trainmem.estimate.heads import logits_width
from trainmem.estimate import loss_parallel as lp
from trainmem.estimate.model_states import model_state_items, optimizer_transient
from trainmem.estimate.peak import Phase, PhasedResult, phases, recompute_per_layer
from trainmem.families import output_modules, tp_roles
from trainmem.inventory import Category, Inventory, MemoryItem, dtype_bytes
from trainmem.names import as_block, is_head, is_token_embedding, layer_index
from trainmem.specs import ImplSpec, ModelSpec, ParallelSpec, StepSpec

__all__ = ["RankClass", "rank_classes", "validate", "stage_layers", "in_flight",
           "apply_tp", "apply_cp", "apply_pp", "apply_zero", "apply_offload", "shard_group"]

_ZERO_BUCKET = 500_000_000  # DeepSpeed's reduce/allgather bucket default, in elements


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
    if par.fsdp_version == 1 and (par.tp > 1 or par.ep > 1 or par.pp > 1):  # estimate/fsdp.py: one flat shard
        raise SpecError("fsdp_version", 1, f"FSDP1 is modelled with data parallelism only, not with {degrees}")
    lp.check(impl.profile, par)
    if impl.float8 != "none" and par.tp > 1 and (step.recipe not in ("fp32", "bf16", "fp16", "fsdp-bf16") or (
            impl.float8 == "tensorwise" and (not par.sp or impl.recompute not in ("none", "full")))):
        # estimate/float8.py _tp_fp8_input: torchao's Float8 TP styles as torchtitan applies them (with SP)
        raise SpecError("float8", impl.float8, f"with tp={par.tp} is modelled in pure precisions (fp32, bf16, "
                        f"fsdp-bf16; precision={step.recipe!r}), tensorwise with sequence parallelism (sp=True, "
                        f"torchtitan's plan; sp={par.sp}) and recompute none or full (recompute={impl.recompute!r})")


def stage_layers(model: ModelSpec, par: ParallelSpec) -> list[tuple[int, int]]:
    """[start, end) layers of each pipeline stage (first stages take the remainder)."""
    if par.layer_split:
        sizes = list(par.layer_split)
    else:
        base, rem = divmod(model.num_layers, par.pp)
        sizes = [base + (1 if s < rem else 0) for s in range(par.pp)]
    out, start = [], 0
    for n in sizes:
        out.append((start, start + n))
        start += n
    return out


def in_flight(par: ParallelSpec, stage: int) -> float:
    """Micro-batches whose activations a stage holds at once, in units of the stage's layers.

    GPipe holds all of them; 1F1B (and zero-bubble ZB-H1, which keeps 1F1B's memory) holds
    ``pp - stage``; interleaved 1F1B with v chunks holds Megatron's warm-up count plus one,
    each chunk being 1/v of the stage.
    """
    m, pp = par.microbatches, par.pp
    if pp == 1:
        return 1
    if par.schedule == "gpipe":
        return m
    if par.schedule == "interleaved":
        v = par.virtual_stages
        warmup = (pp - stage - 1) * 2 + (v - 1) * pp
        return min(m * v, warmup + 1) / v
    return min(pp - stage, m)


# --- sharding of model states -----------------------------------------------------------------

@lru_cache(maxsize=4096)
def _tp_factor(name: str, *, tp: int, ep: int) -> int:
    if ".experts." in name or name.endswith(".experts"):
        return ep * (tp if ep == 1 else 1)
    # column-parallel (split output rows), row-parallel (split input columns), vocab-parallel:
    # every family's and profile's roles (trainmem/families/)
    roles = tp_roles()
    base = name.rsplit(".", 2)[0] if name.count(".") >= 2 else name
    if any(k in name for k in roles.vocab) or any(base.endswith(k) or f".{k}." in name
                                                   for k in roles.column + roles.row):
        return tp
    return 1


def shard_group(par: ParallelSpec) -> int:
    """Ranks that share one copy of the sharded model states: dp × cp, or FSDP's hybrid group."""
    group = par.dp * par.cp
    if par.fsdp == "hybrid":
        group = min(group, par.fsdp_group)
    return group


def _stage_of(name: str, stages: list[tuple[int, int]]) -> int:
    """A block's item goes with its block, a head's (final norm, output layer, loss) to the last
    stage, everything else (embeddings, rotary tables) to the first."""
    li = layer_index(name)
    if li is not None:
        return next(s for s, (a, b) in enumerate(stages) if a <= li < b)
    return len(stages) - 1 if is_head(name) else 0


def _local_item(item: MemoryItem, div: int) -> MemoryItem:
    if div == 1:
        return item
    numel = math.ceil(math.prod(item.shape) / div)  # FSDP pads every shard to the same size
    return MemoryItem.make(item.name, item.category, (numel,), item.dtype,
                           math.ceil(numel * dtype_bytes(item.dtype)), f"⌈{item.formula}/{div}⌉")


# --- the pipeline: pure steps over an inventory ------------------------------------------------
#
# rank_classes composes them: apply_tp (the TP-local model: heads, FFN, vocabulary ÷ tp) and
# apply_cp (the CP-local sequence) shape what the activation rules produce; apply_pp keeps one
# stage's items; apply_zero divides each model state by its TP/EP divisor and, by ZeRO stage, by the
# sharding group; apply_offload moves offloaded states to host.

def apply_cp(step: StepSpec, par: ParallelSpec) -> StepSpec:
    """The step one CP rank computes: the sequence divided by ``cp``."""
    return step if par.cp == 1 else replace(step, seq=step.seq // par.cp)


def apply_pp(items, stage_of, stage: int) -> list[MemoryItem]:
    """The items stage ``stage`` keeps (``stage_of``: each item's stage, in order)."""
    return [it for it, st in zip(items, stage_of) if st == stage]


_ZERO_SHARDED = {Category.OPTIMIZER_STATE: 1, Category.PAGED_STATE: 1, Category.MASTER_WEIGHT: 1, Category.GRADIENT: 2,
                 Category.PARAMETER: 3}
"""The ZeRO stage from which each kind of model state is sharded over the data-parallel group
(stage 1: optimizer states and master weights, 2: + gradients, 3 / FSDP: + parameters)."""


def apply_zero(states, divisors: dict[str, int], *, zero: int, group: int) -> list[MemoryItem]:
    """Each state ÷ its TP/EP divisor, and ÷ ``group`` when ZeRO stage ``zero`` shards its kind
    (one ceiling over the product: FSDP pads every shard to the same size)."""
    out = []
    for it in states:
        div = divisors[it.name]
        if zero >= _ZERO_SHARDED.get(it.category, 4):
            div *= group
        out.append(_local_item(it, div))
    return out


def apply_offload(states, offload: tuple[str, ...]) -> tuple[list[MemoryItem], int]:
    """(states kept on the device, bytes moved to host): ``optimizer`` moves optimizer states and
    master weights (DeepSpeed ZeRO-Offload, FSDP's CPUOffloadPolicy), ``params`` the parameters."""
    moved = set()
    if "optimizer" in offload:
        moved |= {Category.OPTIMIZER_STATE, Category.PAGED_STATE, Category.MASTER_WEIGHT}
    if "params" in offload:
        moved.add(Category.PARAMETER)
    kept = [it for it in states if it.category not in moved]
    return kept, sum(it.bytes for it in states if it.category in moved)


# --- the per-rank estimate --------------------------------------------------------------------

def apply_tp(model: ModelSpec, par: ParallelSpec) -> ModelSpec:
    """The model one TP rank computes: heads, FFN width and vocabulary divided by ``tp``."""
    t = par.tp
    if t == 1:
        return model
    return replace(model, num_heads=model.num_heads // t, num_kv_heads=model.num_kv_heads // t,
                   head_dim=model.head_dim, ffn_size=model.ffn_size // t,
                   vocab_size=-(-model.vocab_size // t),
                   expert_ffn_size=model.expert_ffn_size // t if model.is_moe and par.ep == 1 else model.expert_ffn_size)


def rank_classes(model: ModelSpec, step: StepSpec, impl: ImplSpec, par: ParallelSpec,
                 finetune=None) -> list[RankClass]:
    validate(model, step, impl, par)
    if impl.profile == "megatron" and par.cp > 1:
        raise UnsupportedError("the megatron profile models tensor/sequence parallelism, not context parallelism")
    stages = stage_layers(model, par)
    last = len(stages) - 1
    lm = apply_tp(model, par)
    lstep = apply_cp(step, par)
    shard = Shard(tp=par.tp, sp=par.sp, cp=par.cp, cp_style=par.cp_style, ep=par.ep)
    acts, act_stage, recompute_all = _local_activations(lm, lstep, impl, finetune, shard, tuple(stages))
    loss_lm = lp.loss_model(model, lm, par)  # TP without loss_parallel: the loss reads full-vocabulary logits
    if loss_lm is not lm:
        acts = lp.with_loss_items(acts, _local_activations(loss_lm, lstep, impl, finetune, shard, tuple(stages))[0],
                                  output_modules())
    # model states do not depend on the micro-batch or accumulation (estimate/model_states.py)
    states, state_stage, tp_div = _local_states(model, replace(step, batch=1, grad_accum=1), finetune,
                                                par.tp, par.ep, par.pp, tuple(stages), impl.profile)
    group = shard_group(par)
    zero = 3 if par.fsdp else par.zero
    emb_grad = f"{_embedding_name(states)}.grad"
    torch_engine = impl.profile != "megatron"  # DTensor / FSDP2 / torch.distributed.pipelining
    rotary = [it for it in acts if ".rotary_emb." in it.name]
    bufs = buffer_items(model, step, impl.profile)
    outputs = output_modules()
    d = step.dtypes
    out: list[RankClass] = []
    for s, (a, b) in enumerate(stages):
        stage_acts = apply_pp(acts, act_stage, s)
        head_acts = [it for it in stage_acts if it.name.split(".")[0] in outputs]  # the output layer, loss, task heads
        if s > 0 and par.pp > 1:  # every stage computes its own RoPE tables
            stage_acts = stage_acts + [MemoryItem.make(f"stage{s}.{it.name}", it.category, it.shape, it.dtype,
                                                       it.bytes, it.formula, it.dims) for it in rotary]
        n = in_flight(par, s)
        stage_states = apply_pp(states, [state_stage[it.name] for it in states], s)
        divisors = {it.name: tp_div[it.name] for it in stage_states}
        if torch_engine and emb_grad in divisors and divisors[emb_grad] % par.tp == 0:
            divisors[emb_grad] //= par.tp  # DTensor gives the vocab-parallel embedding a replicated gradient
        sharded = (fsdp1_states(stage_states, world=group) if par.fsdp and par.fsdp_version == 1
                   else apply_zero(stage_states, divisors, zero=zero, group=group))
        # FSDP's CPU offload (estimate/fsdp_offload.py) keeps every sharded model state on the host
        items, host = offload_states(sharded) if cpu_offload(par) else apply_offload(sharded, par.offload)
        items = items + stage_buffers(bufs, s, a, b)  # the model's buffers on this stage (estimate/buffers.py)
        # GPipe runs every forward before any backward: the loss's tensors are held per micro-batch too
        many = [] if par.schedule != "gpipe" else head_acts
        body = sum(it.bytes for it in stage_acts if it not in head_acts or it in many)
        act_off = None
        if composes_with_activation_offload(impl, par):  # each rank as one device: estimate/fsdp_offload.py
            kept, moved, *act_off = rank_activation_offload(
                lm, lstep, impl, stage_acts, {li: v for li, v in recompute_all.items() if a <= li < b}, finetune)
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
        persistent, working = _buffers(_Rank(model=model, local=lm, step=step, local_step=lstep, impl=impl, par=par,
                                             stage=s, last=last, zero=zero, group=group),
                                       [i for i in states if state_stage[i.name] == s], states, tp_div)
        if torch_engine and par.pp > 1 and s == last:
            # torch.distributed.pipelining keeps every micro-batch's output until step() returns
            lb = dtype_bytes(d.activation if d.autocast else d.compute)
            working["forward"]["pp_output_chunks"] = int(par.microbatches * lstep.batch * lstep.seq
                                                         * loss_lm.vocab_size * lb)
            for ph_name in working:
                working[ph_name]["pp_output_chunks"] = working["forward"]["pp_output_chunks"]
        state_bytes = sum(i.bytes for i in items if i.category is Category.OPTIMIZER_STATE)
        full_state = sum(i.bytes for i in states if i.category is Category.OPTIMIZER_STATE)
        tb, rule = optimizer_transient(model, step, states, finetune, impl)  # the single-device rule, whole model
        if "optimizer" in par.offload or cpu_offload(par):
            tb, rule = 0, "optimizer step runs on the host (offloaded)"
        elif full_state:
            tb = int(tb * state_bytes / full_state)
        recompute = {li: v for li, v in recompute_all.items() if a <= li < b}
        if act_off:  # activation offload's stash and in-flight buffers, each block's largest tensor kept
            recompute = act_off[0]
            for ph, parts in act_off[1].items():
                working.setdefault(ph, {}).update(parts)
        lsm = next((i for i in stage_acts if i.name == "loss.log_softmax"), None)
        ph = phases(
            items, B=lstep.batch, S=lstep.seq, vocab=logits_width(loss_lm),
            logits_dtype=d.activation if d.autocast else d.compute,
            loss_dtype=lsm.dtype if lsm else "float32", loss=step.loss if s == last else "none",
            grad_accum=(step.grad_accum if (par.schedule == "gpipe" or (torch_engine and zero == 3)) and par.pp > 1
                        else max(step.grad_accum, par.microbatches)),  # FSDP2 under PP: estimate/fsdp.py
            recompute_bytes=recompute,
            optimizer_transient=(tb, rule),
            residual_bytes=int(lstep.batch * lstep.seq * model.hidden_size * dtype_bytes(d.compute)
                               // (par.tp if par.sp else 1)),
            persistent=persistent, working=working,
        )
        if par.tp > 1 and torch_engine and s == last and step.loss == "ce":  # estimate/loss_parallel.py
            if lp.gathered_logits(par):
                ph = [*ph, lp.gather_phase(next(p for p in ph if p.name == "forward"), B=lstep.batch, S=lstep.seq,
                                           vocab=logits_width(loss_lm), tp=par.tp,
                                           logits_dtype=d.activation if d.autocast else d.compute,
                                           loss_act=sum(i.bytes for i in stage_acts if i.name.startswith("loss.")))]
            else:
                ph = lp.sharded_loss_phases(ph, B=lstep.batch, S=lstep.seq, local_vocab=logits_width(lm),
                                            loss_dtype=lsm.dtype if lsm else "float32")
        if finetune is not None:  # QLoRA: this rank dequantizes its own (TP-local) largest 4-bit weight
            ph = with_dequant_transient(ph, *dequant_transient(lm, finetune),
                                        *(head_dequant(lm, lstep, finetune) if s == last else (0, 0)))
        name = "rank" if par.pp == 1 else f"pp_stage_{s}"
        inv = Inventory(tuple(items) + tuple(
            MemoryItem.make(f"buffers.{k}", Category.BUFFER, (), d.activation, v, "communication buffer")
            for k, v in {**persistent, **_largest_each(working)}.items() if v))
        out.append(RankClass(name, par.dp * par.tp * par.cp, (a, b), inv, tuple(ph), host,
                             int(math.ceil(n))))
    return out


# The two expensive, layout-independent parts are memoized (the planner evaluates many layouts
# that share them): the rank-local activations with the stage keeping each and the recompute per
# block, for one (local model, local step, impl, shard, stages); the model states with each one's
# stage and TP/EP divisor, for one (model, dtypes, optimizer, tp, ep, stages). Results are tuples
# and frozen items, never mutated.

def clear_caches() -> None:
    """Forget the memoized activations and states (benchmarks time cold runs with it)."""
    for f in (_local_activations, _states, _local_states, _state_stages, _tp_divisors, _tp_factor):
        f.cache_clear()


@lru_cache(maxsize=64)
def _local_activations(lm: ModelSpec, lstep: StepSpec, impl: ImplSpec, finetune, shard: Shard,
                       stages: tuple[tuple[int, int], ...]):
    acts, savers = activation_items_with_savers(lm, lstep, impl, finetune, shard)
    plain = acts
    if impl.recompute != "none":
        plain, _ = activation_items_with_savers(lm, lstep, replace(impl, recompute="none", recompute_every=1),
                                                finetune, shard)
    act_stage = tuple(_stage_of(sv, list(stages)) for sv in savers)
    return tuple(acts), act_stage, recompute_per_layer(Inventory(acts), Inventory(plain))


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


def _largest_each(working: dict[str, dict[str, int]]) -> dict[str, int]:
    out: dict[str, int] = {}
    for parts in working.values():
        for k, v in parts.items():
            out[k] = max(out.get(k, 0), v)
    return out


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
            working[p][name] = working[p].get(name, 0) + int(value)

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
        if par.reshard_after_forward and par.fsdp_units != "blocks" and par.fsdp_version == 2:
            # the embedding and head units gathered around their own forward/backward only
            every("fsdp_root_unsharded", root if cpu_offload(par) else root * (1 - 1 / group))
            for ph, v in unit_gathered(block=big, **units, tied=model.tied_embeddings).items():
                every("fsdp_allgather", v, (ph,))
            # each unit's unsharded gradients reduce-scattered after its own backward: the head's
            # first, the embedding's last
            every("fsdp_reduce_scatter", unit_grads["head"], ("backward_start",))
            every("fsdp_reduce_scatter", big_grad, ("backward",))
            every("fsdp_reduce_scatter", max(big_grad, unit_grads["embed"]), ("backward_end",))
        elif par.reshard_after_forward:
            # FSDP2 never reshards the root after forward; one block is gathered ahead of its
            # backward, two (current + prefetched) and a reduce-scatter during the blocks' backward
            # (under CPU offload the root's shard is on the host: the device holds all of it)
            every("fsdp_root_unsharded", root if cpu_offload(par) else root * (1 - 1 / group))
            every("fsdp_allgather", big, ("forward", "backward_start"))
            every("fsdp_allgather", 2 * big, ("backward",))
            every("fsdp_reduce_scatter", big_grad, ("backward", "backward_end"))
        else:
            # gathered parameters stay from forward to backward, next to their shards
            every("fsdp_unsharded_params", sum(math.prod(i.shape) / tp_div[i.name] * gathered(i) for i in stage_params))
            every("fsdp_reduce_scatter", big_grad, ("backward", "backward_end"))
        if cpu_offload(par):  # the shards' copies to and from the device: estimate/fsdp_offload.py
            for ph, parts in offload_working(stage_params, tp_div, grad_bytes, gathered, group, pb,
                                             par.fsdp_units).items():
                for k, v in parts.items():
                    every(k, v, (ph,))
        if par.pp > 1 and impl.profile != "megatron":  # torch.distributed.pipelining: estimate/fsdp.py
            _pp_unsharded(working, stage_params, grad_bytes, tp_div, gathered, par.reshard_after_forward,
                          gpipe=par.schedule == "gpipe")
    if par.cp > 1:
        kv = 2 * lstep.batch * lstep.seq * lm.num_kv_heads * lm.head_dim * act_b
        every("cp_kv_ring" if par.cp_style == "ring" else "cp_kv_allgather", 2 * kv)
    if par.pp > 1:
        tokens = lstep.batch * lstep.seq // (par.tp if par.sp else 1)
        one = tokens * model.hidden_size * act_b
        # torch.distributed.pipelining allocates a receive buffer per micro-batch; Megatron two
        count = par.microbatches if impl.profile != "megatron" else 1
        if r.stage > 0:
            every("pp_recv_activations", count * one)
        if r.stage < r.last:
            every("pp_recv_gradients", count * one)
    return persistent, working


def _pp_unsharded(working: dict[str, dict[str, int]], stage_params: list[MemoryItem], grad_bytes: dict[str, int],
                  tp_div: dict[str, int], gathered, reshard_after_forward: bool, *, gpipe: bool) -> None:
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
    extra = pp_unsharded_working(block_grads=block_grads, root_grads=root, first_grads=first,
                                 block_params=block_params, gpipe=gpipe, reshard_after_forward=reshard_after_forward)
    for ph, parts in extra.items():
        if "fsdp_pp_unsharded_params" in parts:
            working[ph].pop("fsdp_allgather", None)
        working[ph].update({k: int(v) for k, v in parts.items()})
