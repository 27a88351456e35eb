"""Per-rank peak under parallelism: a closed form derived from one single-device estimate.

:func:`breakdown` reads one :class:`~trainmem.estimate.Estimate` (one micro-batch on one device)
into the few sums the peak depends on; :func:`rank_peak` spreads them over a
:class:`~trainmem.specs.ParallelSpec` and rebuilds the estimator's phases (forward,
backward_start, backward, backward_end, optimizer) per pipeline stage. The model states go
through the estimator's own pipeline steps (:mod:`trainmem.estimate.parallel_pp`, ``parallel_zero``), over category
totals instead of tensors: ``stage_layers`` and ``apply_pp`` give each stage its blocks (the
embedding on the first, final norm and head on the last), ``apply_zero`` divides each total by its
TP/EP divisor and, by ZeRO stage, by the sharding group (``shard_group``), ``apply_offload`` moves
offloaded states to host. Each total is kept per TP role (:data:`ROLES`), read item by item with
the estimator's own ``_tp_factor`` (the family registry's TP roles): TP-sharded (column, row and
vocab-parallel weights), replicated (norms, biases of row-parallel layers, routers) and experts
(÷ ep, or ÷ tp without EP); the token embedding's gradient is replicated under the torch engines
(DTensor's vocab-parallel embedding, as the estimator models it), and a tied head keeps its own
copy on the last of several stages; the optimizer step's temporaries scale with the rank's share
of the optimizer states, as in ``rank_classes``. ``in_flight`` is the schedule's count of held
micro-batches. The activations are split to first order:

* a block tensor with a head or FFN axis (A, Akv, F, Fe in its dims) is split by TP; the rest
  (norm inputs, residuals: the ``10sbh`` of Korthikanti et al. 2022, §4.2.2) only with sequence
  parallelism; CP divides every activation (the sequence is split); the head's activations and
  logits are vocab-parallel (÷tp) and split by CP;
* ZeRO-3/FSDP holds two gathered blocks (the current and the prefetched one).

With every degree 1 this reproduces the estimator's phases exactly (a test checks it).

How it relates to ``estimate(..., parallel=...)``: the model-state totals (parameters, master
weights, optimizer states) are the estimator's per rank, up to its per-item padding ceilings (equal
to the byte on gpt2, Llama-3-8B and Mixtral under TP, SP, PP, ZeRO-1/2 and FSDP:
``tests/plan/test_shard_vs_estimate.py``); the peak stays below the estimator's allocated per-rank
peak (0.64-1.00 of it there), as the planner's screen needs (it must drop no configuration the
estimator fits; the shortlist is rechecked with the estimator).

Known limitations:
  - Activations are first order, and there are no TP/DP communication buffers (all-gather,
    reduce-scatter, NCCL buckets, FSDP's unsharded root), loss-parallel temporaries or PP output
    chunks, all of which the estimator adds; uneven vocab shards are rounded, not padded; ZeRO-3
    gathers are two whole blocks. The lower bound is checked on the presets above, not proven.
  - Expert parallelism: the experts' divisor (÷ ep) is the estimator's, but the planner does not
    search EP and nothing models its all-to-all buffers.
  - Only the first and the last pipeline stage are evaluated (the first holds the most
    micro-batches, the last the head).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from functools import lru_cache
from typing import NamedTuple

from trainmem.estimate import Estimate
from trainmem.estimate.parallel_pp import apply_pp, in_flight, stage_layers
from trainmem.estimate.parallel_tp import _tp_factor
from trainmem.estimate.parallel_zero import apply_offload, apply_zero, shard_group
from trainmem.estimate.symbols import names
from trainmem.inventory import Category, MemoryItem
from trainmem.names import as_block, is_embedding, is_head, is_token_embedding, layer_of
from trainmem.specs import ParallelSpec

__all__ = ["Breakdown", "breakdown", "rank_peak", "StagePeak", "clear_cache", "ROLES"]

_TP_DIMS = frozenset({"A", "Akv", "F", "Fe"})
_CATEGORIES = (Category.PARAMETER, Category.GRADIENT, Category.MASTER_WEIGHT, Category.OPTIMIZER_STATE)
#: the TP roles a state total is kept under: replicated (÷ 1), TP-sharded (÷ tp), experts (÷ ep, or ÷ tp without EP),
#: and the token embedding's gradient under the torch engines: DTensor's vocab-parallel embedding gives it a
#: replicated gradient (÷ 1), which FSDP2 reduce-scatters into the sharded parameter's layout (÷ tp, then the
#: shard group; estimate/parallel.py rank_classes, checked by trace/parallel_2d.py)
ROLES = ("replicated", "tp", "experts", "vocab_grad")
_PROBE_TP, _PROBE_EP = 2, 3  # _tp_factor's answer at these degrees names the role: 1, 2 or 3


@dataclass(frozen=True)
class Breakdown:
    """The sums a per-rank peak depends on, for one micro-batch on one device (bytes)."""

    num_layers: int
    block_states: tuple[tuple[int, int, int, int], ...]
    """Per TP role (:data:`ROLES`): (parameter, gradient, master_weight, optimizer_state) of all blocks together."""
    embed_states: tuple[tuple[int, int, int, int], ...]
    """The same for the input embeddings (first pipeline stage)."""
    head_states: tuple[tuple[int, int, int, int], ...]
    """The same for everything else outside blocks: final norm, LM head (last stage)."""
    largest_block_params: tuple[int, int, int]
    """The parameters of the largest block, per TP role."""
    act_split: int
    """Block activations with a head/FFN dimension (split by TP), all blocks."""
    act_replicated: int
    """Block activations TP leaves whole (split only with sequence parallelism), all blocks."""
    act_first: int
    """Activations outside blocks before them (embedding indices, rotary tables)."""
    act_head: int
    """Activations of the final norm, head and loss."""
    logits: int
    """Phase ``forward``'s logits (and fp32 copy); 0 for a chunked loss."""
    logits_grad: int
    """Phase ``backward_start``'s logit gradients; 0 for a chunked loss."""
    head_grads: int
    """Phase ``backward``'s gradients without accumulation (the head's)."""
    work: int
    """Phase ``backward``'s recomputed block and gradient working set."""
    work_end: int
    """Phase ``backward_end``'s working set."""
    optimizer_temporaries: int
    has_backward: bool
    ce_phases: bool
    tied_head_states: tuple[tuple[int, int, int, int], ...] = ((0,) * 4,) * len(ROLES)
    """Tied embeddings: the states of the last stage's own copy of the head under PP (as the
    estimator's ``_states`` ``tied_copy``: the token embedding's items named as ``lm_head.weight``)."""
    buffers: tuple[int, int, int] = (0, 0, 0)
    """The model's buffers (``estimate/buffers.py``): (rotary tables', on every stage; the other ones
    outside blocks, on the first; the blocks', all blocks), replicated by TP, never sharded."""
    caller_batch: int = 0
    """Phase ``optimizer``'s caller batch (its ``caller_ids``, estimate/phase_inputs.py ``optimizer_batch``): the
    token ids the loop binds through ``optimizer.step()``; under PP the whole batch on the first and the last
    stage (estimate/parallel_pp.py ``optimizer_batch``)."""

    def scaled(self, other: "Breakdown", batch: int) -> "Breakdown":
        """Affine extrapolation in the micro-batch: ``self`` at B=1, ``other`` at B=2 -> B=batch.
        Every activation term is B × (per-sequence bytes) + (B-independent bytes)."""
        out = {}
        for f in fields(self):
            a, b = getattr(self, f.name), getattr(other, f.name)
            if isinstance(a, int) and not isinstance(a, bool):
                out[f.name] = a + (b - a) * (batch - 1)
            else:
                out[f.name] = a
        return Breakdown(**out)


def _tp_split(dims: tuple[str, ...]) -> bool:
    """A head or FFN axis and no hidden axis (routed-token tensors such as the experts' gathered
    input are H wide, whatever their other axes)."""
    symbols = set().union(*map(names, dims)) if dims else set()
    return bool(symbols & _TP_DIMS) and "H" not in dims


def _role(name: str, li: int | None, memo: dict[str, int]) -> int:
    """The index in :data:`ROLES` of a state item, by the estimator's ``_tp_factor`` (called on the
    block-0 name, as ``rank_classes``' ``_tp_divisors`` does; ``memo``: one call per name in a block)."""
    key = name if li is None else name.replace(f".{li}.", ".#.", 1)
    r = memo.get(key)
    if r is None:
        f = _tp_factor(as_block(name), tp=_PROBE_TP, ep=_PROBE_EP)
        r = memo[key] = {1: 0, _PROBE_TP: 1, _PROBE_EP: 2}[f]
    return r


def breakdown(e: Estimate) -> Breakdown:
    """Read an estimate into a :class:`Breakdown`."""
    block = [[0] * 4 for _ in ROLES]
    embed = [[0] * 4 for _ in ROLES]
    head = [[0] * 4 for _ in ROLES]
    tied = [[0] * 4 for _ in ROLES]
    layer_params: dict[int, list[int]] = {}
    emb = next((it.name for it in e.inventory if it.category is Category.PARAMETER and is_token_embedding(it.name)),
               None) if e.model.tied_embeddings else None
    torch_engine = e.impl.profile != "megatron"  # estimate/parallel.py rank_classes: DTensor's replicated gradient
    act_split = act_rep = act_first = act_head = 0
    index = {c.value: i for i, c in enumerate(_CATEGORIES)}
    bufs = [0, 0, 0]
    memo: dict[str, int] = {}
    for it in e.inventory:
        li = layer_of(it.name)
        if it.category is Category.BUFFER:  # the single-device estimate's are the model's own
            bufs[2 if li is not None else 0 if ".rotary_emb." in it.name else 1] += it.bytes
            continue
        if it.category is Category.ACTIVATION:
            if li is not None:
                if _tp_split(it.dims):
                    act_split += it.bytes
                else:
                    act_rep += it.bytes
            elif is_head(it.name):
                act_head += it.bytes
            else:
                act_first += it.bytes
            continue
        k = index.get(it.category.value)
        if k is None:
            continue
        replicated_grad = (li is None and torch_engine and it.category is Category.GRADIENT
                           and is_token_embedding(it.name))
        r = 3 if replicated_grad else _role(it.name, li, memo)
        if emb is not None and it.name.startswith(emb):
            tied[_role(it.name.replace(emb, "lm_head.weight", 1), None, memo)][k] += it.bytes
        if li is not None:
            block[r][k] += it.bytes
            if k == 0:
                layer_params.setdefault(li, [0, 0, 0])[r] += it.bytes
        elif is_embedding(it.name):
            embed[r][k] += it.bytes
        else:
            head[r][k] += it.bytes
    ph = {p.name: p for p in e.phases}
    return Breakdown(
        num_layers=e.model.num_layers,
        block_states=tuple(map(tuple, block)), embed_states=tuple(map(tuple, embed)),
        head_states=tuple(map(tuple, head)), tied_head_states=tuple(map(tuple, tied)),
        largest_block_params=tuple(max(layer_params.values(), key=sum, default=[0, 0, 0])),
        act_split=act_split, act_replicated=act_rep, act_first=act_first, act_head=act_head,
        logits=ph["forward"].parts.get("logits", 0),
        logits_grad=ph["backward_start"].parts.get("logits_grad", 0) if "backward_start" in ph else 0,
        head_grads=ph["backward"].parts.get("gradients", 0) if "backward" in ph else 0,
        work=ph["backward"].parts.get("recompute_and_work", 0) if "backward" in ph else 0,
        work_end=ph["backward_end"].parts.get("work", 0),
        optimizer_temporaries=ph["optimizer"].parts.get("optimizer_temporaries", 0),
        has_backward="backward" in ph, ce_phases="backward_start" in ph, buffers=tuple(bufs),
        caller_batch=ph["optimizer"].parts.get("caller_ids", 0),
    )


#: Each phase of :func:`rank_peak` and its parts besides parameters, master weights and optimizer states.
_PARTS = (
    ("forward", ("activations", "gradients", "gathered_params", "logits")),
    ("backward_start", ("activations", "gradients", "gathered_params", "logits_grad")),
    ("backward", ("activations", "gradients", "gathered_params", "recompute_and_work")),
    ("backward_end", ("activations", "gradients", "gathered_params", "work")),
    ("optimizer", ("gradients", "optimizer_temporaries", "caller_ids")),
)


@dataclass(frozen=True)
class StagePeak:
    """The peak of one rank class (a pipeline stage)."""

    stage: str
    peak_bytes: int
    phase: str
    parts: dict[str, int]
    host_bytes: int


class _Depth(NamedTuple):
    """What :func:`~trainmem.estimate.parallel_pp.stage_layers` reads of a model: its depth."""

    num_layers: int


def _totals(prefix: str, roles: tuple, fraction: float = 1.0) -> list[MemoryItem]:
    """One item per TP role and ledger: the category total as a byte array (a shard's ceiling is
    in bytes), named ``{prefix}.{role}.{category}``."""
    out = []
    for role, ledgers in zip(ROLES, roles):
        for cat, value in zip(_CATEGORIES, ledgers):
            n = int(round(value * fraction))
            if n:
                out.append(MemoryItem.make(f"{prefix}.{role}.{cat.value}", cat, (n,), "uint8", n))
    return out


def _role_divisors(tp: int, ep: int, fsdp: bool) -> dict[str, int]:
    """Each role's TP/EP divisor, as the estimator's ``_tp_factor`` gives its items."""
    return {"replicated": 1, "tp": tp, "experts": ep * (tp if ep == 1 else 1), "vocab_grad": tp if fsdp else 1}


@lru_cache(maxsize=4096)
def _stage_states(states: tuple, tp: int, ep: int, pp: int, layer_split: tuple, zero: int, group: int,
                  offload: tuple, stage: int, fsdp: bool = False) -> tuple[float, float, float, float, float, float]:
    """(parameters, gradients, master weights, optimizer states, optimizer temporaries, host
    bytes) of pipeline stage ``stage``, through the estimator's own pipeline steps."""
    num_layers, block, embed, head, tied, temporaries = states
    stages = stage_layers(_Depth(num_layers), _Layout(pp, layer_split))
    items, stage_of = [], []
    for s, (a, b) in enumerate(stages):
        here = _totals(f"stage{s}.blocks", block, (b - a) / num_layers)
        items += here
        stage_of += [s] * len(here)
    last = len(stages) - 1
    for prefix, ledgers, s in (("embedding", embed, 0), ("head", head, last),
                               ("tied_head", tied if last else (), last)):
        here = _totals(prefix, ledgers)
        items += here
        stage_of += [s] * len(here)
    kept = apply_pp(items, stage_of, stage)
    role_div = _role_divisors(tp, ep, fsdp)
    sharded = apply_zero(kept, {it.name: role_div[it.name.split(".")[-2]] for it in kept}, zero=zero, group=group)
    on_device, host = apply_offload(sharded, offload)
    sums = dict.fromkeys(_CATEGORIES, 0)
    for it in on_device:
        sums[it.category] += it.bytes
    # the optimizer step's temporaries scale with this rank's optimizer states (rank_classes:
    # the single-device rule × state bytes on this rank / the whole model's)
    full = sum(r[3] for part in (block, embed, head, tied if last else ()) for r in part)
    temps = temporaries * sums[Category.OPTIMIZER_STATE] / full if full else 0
    return (*(sums[c] for c in _CATEGORIES), temps, host)


def clear_cache() -> None:
    """Forget the memoized per-stage model states (benchmarks time cold runs with it)."""
    _stage_states.cache_clear()


class _Layout(NamedTuple):
    """What :func:`~trainmem.estimate.parallel_pp.stage_layers` reads of a ParallelSpec."""

    pp: int
    layer_split: tuple


def rank_peak(b: Breakdown, p: ParallelSpec, *, accumulate: bool, detail: bool = True) -> list[StagePeak]:
    """Per-stage peaks (first stage, and the last when pp > 1) for the micro-batch ``b`` describes.
    ``accumulate``: gradients persist across micro-batches (grad_accum or pipeline micro-batches > 1).
    ``detail=False`` leaves ``parts`` empty (the planner's inner loop)."""
    L = b.num_layers
    zero = 3 if p.fsdp is not None else p.zero
    group = shard_group(p)
    rep = p.tp if p.sp else 1
    block_act = (b.act_split / p.tp + b.act_replicated / rep) / L / p.cp  # one block, one micro-batch
    states = (L, b.block_states, b.embed_states, b.head_states, b.tied_head_states, b.optimizer_temporaries)
    ep = getattr(p, "ep", 1)  # the planner's records have no EP: 1
    role_div = tuple(_role_divisors(p.tp, ep, p.fsdp is not None).values())
    layers = stage_layers(_Depth(L), p)
    stages = [("first", 0)] + ([("last", p.pp - 1)] if p.pp > 1 else [])
    out = []
    for name, s in stages:
        first, last = s == 0, s == p.pp - 1
        P, G, M, O, temps, host = _stage_states(states, p.tp, ep, p.pp, tuple(p.layer_split), zero, group,
                                                tuple(p.offload), s, p.fsdp is not None)
        gathered = 2 * sum(n / d for n, d in zip(b.largest_block_params, role_div)) if zero >= 3 else 0.0
        A_blocks = in_flight(p, s) * (layers[s][1] - layers[s][0]) * block_act
        A_first = b.act_first / p.cp if first else 0.0
        A_head = b.act_head / (p.tp * p.cp) if last else 0.0
        A = A_blocks + A_first + A_head
        g_acc = G if accumulate else 0.0
        lg = 1 / (p.tp * p.cp)
        head_g = b.head_grads / p.tp / (group if zero >= 2 else 1) if last else 0.0
        values = (  # in the order of _PARTS
            (A, g_acc, gathered, b.logits * lg if b.ce_phases and last else 0.0),
            (A, g_acc, gathered, b.logits_grad * lg if last else 0.0) if b.ce_phases else None,
            (A - A_head, G if accumulate else head_g, gathered, b.work * lg) if b.has_backward else None,
            (A_first, G, gathered, b.work_end / (rep * p.cp)),
            (G, temps, b.caller_batch * (p.microbatches if p.pp > 1 else 1)),  # first and last stage: the batch
        )
        rotary_buf, outside_buf, block_buf = b.buffers
        buf = rotary_buf + (outside_buf if first else 0) + block_buf * (layers[s][1] - layers[s][0]) / L
        base = P + M + O + buf
        best, best_total = 0, -1.0
        for i, vals in enumerate(values):
            if vals is not None:
                total = base + sum(vals)
                if total > best_total:
                    best, best_total = i, total
        ph, names = _PARTS[best]
        parts = {}
        if detail:
            full = {"parameters": P, "master_weights": M, "optimizer_states": O, "buffers": buf,
                    **dict(zip(names, values[best]))}
            parts = {k: int(round(v)) for k, v in full.items() if v}
        out.append(StagePeak(name, int(round(best_total)), ph, parts, host))
    return out
