"""Inference memory per rank: weights (in a serving format), the prefill working set, the KV cache
(GQA/MQA, paged, in its own dtype), and how many sequences a GPU's KV pool holds.

No autograd: a forward frees each intermediate once its consumer has run, so the activation peak is
one block's live set, not the sum over blocks. The live set is modelled from the training saved set
of one block in execution order (the inventory's order): the residual stream, plus the largest
three consecutive tensors (an op's inputs and its output; e.g. gate, up and act·up in a SwiGLU MLP,
or the fp32 scores and bf16 probabilities of eager attention). With chunked prefill
(``prefill_chunk=N``) the forward runs N prompt tokens at a time: the live set is that of N tokens,
the cache still holds the whole context.

KV cache (vLLM's paged attention, Kwon et al. 2023, §4.1: memory in fixed blocks of tokens), per rank::

    2 (K and V) · stage layers · batch · ⌈context / block⌉·block · kv_heads_per_rank · head_dim · kv_bytes

with ``kv_heads_per_rank = max(1, Akv / tp)`` (vLLM replicates KV heads when tp > Akv:
:mod:`trainmem.estimate.inference_weights`). Weights per rank and per format: the same module.
Pipeline stages split the layers as vLLM does (:func:`serving_stages`), or by ``layer_split``.

Phases: ``prefill`` (weights + cache + one block's live set), ``prefill_logits`` (last stage: weights +
cache + the logits: the last position's only, in fp32, ⌈V/tp⌉ wide, unless ``all_logits``),
``decode`` (weights + cache + one token's live set, negligible).

Capacity (``gpu=``), as vLLM sizes its KV pool (vllm/worker/worker.py, Worker.determine_num_available_blocks;
CacheEngine.get_cache_block_size)::

    blocks = (capacity · gpu_memory_utilization − CUDA context (+ NCCL) − (peak − KV cache)) // block_bytes
    block_bytes = 2 · stage layers · block · kv_heads_per_rank · head_dim · kv_bytes

the fewest over the ranks (the executor takes the minimum over its workers), and the concurrent
sequences ``blocks // ⌈context/block⌉``. ``gpu_memory_utilization`` defaults to vLLM's 0.9
(vllm/engine/arg_utils.py, EngineArgs.gpu_memory_utilization).

Sliding-window and chunked-attention blocks (``ModelSpec.kind(i)``, window W) keep at most W tokens,
as transformers' ``DynamicCache(config=...)`` does (cache_utils.py ``DynamicSlidingWindowLayer.update``):
each step keeps the last W − 1 tokens as a view of ``cat(kept, new)``, so once a token is decoded
the storage is W tokens; right after the prefill it is still the whole prompt's (``min(S, W − 1 +
chunk)`` tokens with chunked prefill), which the prefill phases add (``kv_prompt_past_window``).

Known limitations:
  - No cross-layer cache sharing, no MLA; encoders have no cache; linear-attention blocks are
    counted as full attention. The KV pool's capacity counts every block at the full context.
  - The prefill live set is an upper-bound heuristic from the saved set, not a trace; chunked
    prefill is modelled for SDPA/flash attention (eager scores over chunk × context are refused).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import cached_property

from trainmem.errors import SpecError
from trainmem.estimate import Estimate
from trainmem.estimate.activations import activation_items
from trainmem.estimate.inference_weights import (KV_DTYPES, WEIGHT_FORMATS, check_tp, kv_heads_per_rank,
                                                 rank_weight_items)
from trainmem.estimate.model_states import model_state_items
from trainmem.estimate.parallel import RankClass
from trainmem.estimate.peak import Phase
from trainmem.estimate.symbols import formula
from trainmem.families import family_of
from trainmem.inventory import Category, Inventory, MemoryItem, dtype_bytes
from trainmem.names import layer_of
from trainmem.specs import ImplSpec, ModelSpec, ParallelSpec, StepSpec
from trainmem import validate as v

__all__ = ["inference_estimate", "kv_cache_bytes", "serving_stages", "ServingSpec", "Capacity", "InferenceEstimate"]

VLLM_GPU_MEMORY_UTILIZATION = 0.9  # vllm/engine/arg_utils.py, EngineArgs.gpu_memory_utilization


@dataclass(frozen=True)
class ServingSpec:
    """What a server holds: the context per sequence, cache pages and dtype, weight format, prefill chunk."""

    context: int
    block_size: int = 16
    weights: str | None = None
    """bf16, fp16, fp8, int8, int4; None: the parameters as ``--precision`` stores them."""
    weight_group: int = 128
    """int4: input columns per fp16 scale (AWQ/GPTQ group size)."""
    kv_dtype: str | None = None
    """bf16, fp16, fp8; None: the activation dtype."""
    prefill_chunk: int | None = None
    all_logits: bool = False
    gpu_memory_utilization: float = VLLM_GPU_MEMORY_UTILIZATION

    def __post_init__(self) -> None:
        for name in ("context", "block_size", "weight_group"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise SpecError(name, value, "must be a positive integer")
        if self.prefill_chunk is not None and (isinstance(self.prefill_chunk, bool) or
                                               not isinstance(self.prefill_chunk, int) or self.prefill_chunk <= 0):
            raise SpecError("prefill_chunk", self.prefill_chunk, "must be a positive integer")
        if self.weights is not None:
            v.one_of("weights", self.weights, tuple(WEIGHT_FORMATS))
        if self.kv_dtype is not None:
            v.one_of("kv_dtype", self.kv_dtype, tuple(KV_DTYPES))
        u = self.gpu_memory_utilization
        if isinstance(u, bool) or not isinstance(u, (int, float)) or not 0 < u <= 1:
            raise SpecError("gpu_memory_utilization", u, "must be in (0, 1]")

    def to_dict(self) -> dict:
        return dict(self.__dict__)


@dataclass(frozen=True)
class Capacity:
    """The KV pool one GPU per rank holds, and the concurrent sequences of ``context`` tokens it fits."""

    gpu: str
    gpus: int
    context: int
    block_size: int
    block_bytes: int
    blocks: int
    pool_bytes: int
    sequences: int
    rank: str

    def to_dict(self) -> dict:
        return dict(self.__dict__)


@dataclass(frozen=True)
class InferenceEstimate(Estimate):
    serving: ServingSpec | None = None
    capacity: Capacity | None = None

    @cached_property
    def notes(self) -> tuple[str, ...]:  # training notes (optimizer, loss) do not apply
        return ()

    def to_dict(self, *, items: bool = True) -> dict:
        out = super().to_dict(items=items)
        out["serving"] = self.serving.to_dict() if self.serving else None
        out["capacity"] = self.capacity.to_dict() if self.capacity else None
        return out


def _cache_dtype(step: StepSpec) -> str:
    d = step.dtypes
    return d.activation if d.autocast else d.param


def kv_cache_bytes(model: ModelSpec, *, batch: int, context: int, dtype: str = "bfloat16", block_size: int = 1,
                   tp: int = 1, layers: int | None = None) -> int:
    """2 · L · B · ⌈context/block⌉·block · kv_heads_per_rank · head_dim · dtype_bytes (0 for encoders)."""
    if model.arch != "decoder":
        return 0
    tokens = -(-context // block_size) * block_size
    L = model.num_layers if layers is None else layers
    return int(2 * L * batch * tokens * kv_heads_per_rank(model, tp) * model.head_dim * dtype_bytes(dtype))


def _window(model: ModelSpec, i: int) -> int:
    """Block ``i``'s attention window (0: full), the tokens its cache keeps while decoding."""
    kind = model.kind(i)
    return kind.window if kind.attention in ("sliding", "chunked") else 0


def _block_live_set(items: list[MemoryItem], layer: int) -> tuple[int, list[str]]:
    """Largest sum of three consecutive saved tensors of block ``layer`` (execution order)."""
    block = [it for it in items if layer_of(it.name) == layer]
    best, names = 0, []
    for i in range(len(block)):
        window = block[i:i + 3]
        total = sum(it.bytes for it in window)
        if total > best:
            best, names = total, [it.name for it in window]
    return best, names


def serving_stages(num_layers: int, par: ParallelSpec) -> list[tuple[int, int]]:
    """[start, end) layers of each pipeline stage. vLLM (vllm/distributed/utils.py, get_pp_indices) gives
    every stage ⌊L/pp⌋ and the remainder one each to the stages before the last, from the second-last
    backwards (the first and last hold the embedding and the head); ``layer_split`` is its
    VLLM_PP_LAYER_PARTITION."""
    if par.layer_split:
        sizes = list(par.layer_split)
        if len(sizes) != par.pp or sum(sizes) != num_layers or min(sizes) < 1:
            raise SpecError("layer_split", par.layer_split, f"needs pp={par.pp} positive entries summing to "
                                                            f"{num_layers} layers")
    else:
        sizes = [num_layers // par.pp] * par.pp
        for i in range(2, num_layers % par.pp + 2):
            sizes[-i] += 1
    bounds = [sum(sizes[:s]) for s in range(par.pp + 1)]
    return list(zip(bounds, bounds[1:]))


def _check_parallel(par: ParallelSpec) -> None:
    for name, value, plain in (("cp", par.cp, 1), ("ep", par.ep, 1), ("sp", par.sp, False), ("zero", par.zero, 0),
                               ("fsdp", par.fsdp, None), ("offload", par.offload, ())):
        if value != plain:
            raise SpecError(name, value, "is a training layout: serving models --tp, --pp and --dp (replicas)")


def _stage_of(name: str, stages: list[tuple[int, int]]) -> int:
    """A parameter's pipeline stage: its layer's; embeddings on the first, norm and head on the last."""
    li = layer_of(name)
    if li is not None:
        return next(s for s, (a, b) in enumerate(stages) if a <= li < b)
    return 0 if "embed" in name and "embed_out" not in name or name.startswith(("transformer.wte", "transformer.wpe")) \
        else len(stages) - 1


def _dense_dtype(step: StepSpec, weights: str) -> str:
    if weights == "fp16":
        return "float16"
    if weights == "bf16":
        return "bfloat16"
    return "float16" if _cache_dtype(step) == "float16" else "bfloat16"


def inference_estimate(model: ModelSpec, step: StepSpec, impl: ImplSpec | None = None,
                       parallel: ParallelSpec | None = None, *, context: int, block_size: int = 16,
                       all_logits: bool = False, weights: str | None = None, weight_group: int = 128,
                       kv_dtype: str | None = None, prefill_chunk: int | None = None, gpu=None,
                       gpu_memory_utilization: float = VLLM_GPU_MEMORY_UTILIZATION) -> InferenceEstimate:
    """Memory of serving ``model`` per rank: ``step.batch`` sequences, a prompt of ``step.seq`` tokens
    and a cache of ``context`` tokens each (prompt + generated), in pages of ``block_size`` tokens.
    ``gpu`` (a :class:`trainmem.plan.hardware.GPU`): also the concurrent sequences its KV pool fits."""
    impl = impl or ImplSpec()
    par = parallel or ParallelSpec()
    serving = ServingSpec(context=context, block_size=block_size, weights=weights, weight_group=weight_group,
                          kv_dtype=kv_dtype, prefill_chunk=prefill_chunk, all_logits=all_logits,
                          gpu_memory_utilization=gpu_memory_utilization)
    _check_parallel(par)
    if step.dtypes.gathered:
        raise SpecError("precision", step.precision, "is FSDP2's training recipe; serve the weights as bf16")
    if context < step.seq and model.arch == "decoder":
        raise SpecError("context", context, f"must be at least the prompt length seq={step.seq}")
    if prefill_chunk is not None and impl.attention == "eager":
        raise SpecError("prefill_chunk", prefill_chunk, "is modelled with sdpa/flash attention (eager scores "
                                                        "span chunk × context): use --attention sdpa")
    if par.tp > 1:
        check_tp(model, par.tp)
    if par.pp > model.num_layers:
        raise SpecError("pp", par.pp, f"exceeds the model's layers ({model.num_layers})")
    step = replace(step, mode="inference", grad_accum=1)
    tp, B = par.tp, step.batch
    stages = serving_stages(model.num_layers, par)
    dt = _cache_dtype(step)
    kv_dt = KV_DTYPES[kv_dtype] if kv_dtype else dt
    params = model_state_items(model, step)  # parameters only in inference mode
    if len(stages) > 1 and model.tied_embeddings:  # vLLM llama.py: the last rank keeps embed_tokens as its head
        emb = next(it for it in params if _stage_of(it.name, stages) == 0 and layer_of(it.name) is None
                   and len(it.shape) == 2)
        params = params + [MemoryItem.make("lm_head.weight", Category.PARAMETER, emb.shape, emb.dtype, emb.bytes,
                                           emb.formula, emb.dims)]
    params = rank_weight_items(model, params, tp=tp, weights=weights,
                               dense_dtype=_dense_dtype(step, weights) if weights else dt, group=weight_group)
    kv_local = kv_heads_per_rank(model, tp)
    lm = model if tp == 1 else replace(model, num_heads=model.num_heads // tp, num_kv_heads=kv_local,
                                       ffn_size=model.ffn_size // tp, vocab_size=-(-model.vocab_size // tp))
    tokens = min(prefill_chunk or step.seq, step.seq)
    acts = activation_items(lm, replace(step, mode="train", seq=tokens),
                            replace(impl, recompute="none", recompute_every=1))
    prefix = family_of(model).layers  # the KV cache items live in the model's blocks
    kv_axis = "1" if tp > model.num_kv_heads else ("Akv" if tp == 1 else "Akv/tp")
    dims = ("2", "B", kv_axis, f"⌈ctx/{block_size}⌉·{block_size}", "hd")
    ranks = []
    for s, (a, b) in enumerate(stages):
        last = s == len(stages) - 1
        weights_s = [it for it in params if _stage_of(it.name, stages) == s]
        cache: list[MemoryItem] = []
        past_window = 0  # a sliding block's prompt tokens past its window, held until the first decode step
        if model.arch == "decoder":
            for i in range(a, b):
                w = _window(model, i)
                kept, d = (min(context, w), dims[:3] + (f"⌈min(ctx,{w})/{block_size}⌉·{block_size}", "hd")) \
                    if w else (context, dims)
                per_layer = kv_cache_bytes(model, batch=B, context=kept, dtype=kv_dt, block_size=block_size, tp=tp,
                                           layers=1)
                shape = (2, B, kv_local, -(-kept // block_size) * block_size, model.head_dim)
                cache.append(MemoryItem.make(f"{prefix}.{i}.self_attn.kv_cache", Category.KV_CACHE, shape, kv_dt,
                                             per_layer, formula(d, dtype_bytes(kv_dt)), d))
                if w:
                    held = min(step.seq, w - 1 + tokens)
                    past_window += max(0, kv_cache_bytes(model, batch=B, context=held, dtype=kv_dt,
                                                         block_size=block_size, tp=tp, layers=1) - per_layer)
        past = {"kv_prompt_past_window": past_window} if past_window else {}
        live, names = _block_live_set(acts, a)
        resid = int(B * tokens * model.hidden_size * dtype_bytes(dt))
        rows = B * step.seq if all_logits else B
        logits = int(rows * lm.vocab_size * 4)
        P = sum(it.bytes for it in weights_s)
        K = sum(it.bytes for it in cache)
        decode_live = int(B * max(model.hidden_size, lm.ffn_size) * 3 * dtype_bytes(dt))
        over = f"a chunk of {tokens} prompt tokens" if prefill_chunk else "the prompt"
        ph = [Phase("prefill", P + K + past_window + resid + live,
                    {"parameters": P, "kv_cache": K, **past, "residual": resid, "block_live": live},
                    f"one block's forward over {over}: residual stream + "
                    f"{', '.join(n.rsplit('.', 2)[-2] + '.' + n.rsplit('.', 1)[-1] for n in names)}")]
        if last:
            ph.append(Phase("prefill_logits", P + K + past_window + logits,
                            {"parameters": P, "kv_cache": K, **past, "logits": logits},
                            f"fp32 logits of {'every prompt position' if all_logits else 'the last position'} "
                            f"(B·{'S·' if all_logits else ''}{'⌈V/tp⌉' if tp > 1 else 'V'}·4)"))
        ph.append(Phase("decode", P + K + decode_live, {"parameters": P, "kv_cache": K, "token_live": decode_live},
                        "one generated token: the cache dominates"))
        name = f"stage {s}" if len(stages) > 1 else "rank"
        ranks.append(RankClass(name, par.dp * tp, (a, b), Inventory(tuple(weights_s) + tuple(cache)), tuple(ph),
                               0, 1))
    capacity = _capacity(gpu, ranks, model, serving, tp=tp, kv_dtype=kv_dt, gpus=tp * len(stages)) if gpu else None
    worst = max(ranks, key=lambda r: r.peak_bytes)
    multi = tp > 1 or len(stages) > 1 or par.dp > 1
    return InferenceEstimate(model, step, impl, worst.inventory, worst.phases, parallel=par,
                             ranks=tuple(ranks) if multi else (), serving=serving, capacity=capacity)


def _capacity(gpu, ranks: list[RankClass], model: ModelSpec, serving: ServingSpec, *, tp: int, kv_dtype: str,
              gpus: int) -> Capacity:
    """vLLM's KV pool: what is left of capacity·utilization after the memory outside torch (the CUDA
    context, and NCCL's buffers on more than one GPU: trainmem.fits, the one usable-memory model), the
    weights and the profiled forward's peak, in blocks; the fewest over the ranks."""
    from trainmem.fits import context_bytes
    if model.arch != "decoder":
        raise SpecError("gpu", gpu.name, f"sizes a KV cache; {model.name} is an encoder and keeps none")
    best = None
    for r in ranks:
        no_kv_peak = max(p.bytes - p.parts.get("kv_cache", 0) for p in r.phases)
        block_bytes = kv_cache_bytes(model, batch=1, context=serving.block_size, dtype=kv_dtype,
                                     block_size=serving.block_size, tp=tp, layers=r.layers[1] - r.layers[0])
        pool = int(gpu.memory_bytes * serving.gpu_memory_utilization) - context_bytes(gpu, gpus) - no_kv_peak
        blocks = max(0, pool // block_bytes)
        if best is None or blocks < best[0]:
            best = (blocks, block_bytes, max(0, pool), r.name)
    blocks, block_bytes, pool, name = best
    per_seq = -(-serving.context // serving.block_size)
    return Capacity(gpu.name, gpus, serving.context, serving.block_size, block_bytes, blocks, pool,
                    blocks // per_seq, name)
