"""Estimated step time of a parallel configuration: compute, communication, pipeline bubble, offload.

A first-order model for *ranking* configurations, not a performance prediction:

* compute: 6·N FLOPs per token for the matmuls (N = parameters that take part in a matmul, so not
  the input embedding unless it is tied to the head) plus 6·L·S·(A·hd) per token for causal
  attention scores and values (the 12·L·S·H of PaLM, Chowdhery et al. 2022, App. B, halved for
  the causal mask); full recompute adds one forward (2·N + 2·L·S·A·hd), selective recompute the
  attention core's forward (2·L·S·A·hd). Time = FLOPs / (world × peak × MFU), with GEMMs under
  ``min_gemm_rows`` local rows slowed proportionally and eager (materialized) attention's
  score FLOPs slowed by ``eager_attention_slowdown``;
* tensor parallelism (Megatron, Shoeybi et al. 2019): 2 all-reduces of B·S·H per block in forward
  and 2 in backward (with SP the same volume as all-gather + reduce-scatter), 2 more forward ones
  under full recompute; ring all-reduce moves 2(t−1)/t of the buffer;
* context parallelism (ring attention): each block passes K and V around the ring in forward
  and K, V and their gradients in backward;
* pipeline: one B·S·H activation forward and one gradient backward per micro-batch and stage
  boundary; the 1F1B bubble multiplies the pipelined time by 1 + (pp−1)/m;
* data parallelism: the gradient all-reduce (ZeRO-1: reduce-scatter + all-gather, same volume)
  once per step; ZeRO-2 reduce-scatters every micro-batch; ZeRO-3 also all-gathers parameters
  in forward and again in backward every micro-batch (1.5× the all-reduce volume per micro-batch).
  This traffic overlaps with backward compute; only what exceeds the compute time counts;
* optimizer offload: gradients to host and parameters back over PCIe each step, plus a CPU Adam
  at ``cpu_adam_params_per_s``; FSDP's CPU offload (``--fsdp --offload params``): each
  micro-batch's gradient shards to the host, the CPU Adam, and the parameter shards to the device
  for the forward's and the backward's all-gathers;
* bitsandbytes' paged optimizers (``paged-adamw8bit``, ``paged-adamw32bit``, ``paged-lion8bit``,
  ``paged-lion32bit``): their states sit in CUDA unified memory, which the driver pages to the host
  only when the device runs short -- the reason to page. Priced as that case: every paged state byte
  out and back over PCIe each step (per trainable parameter: Adam's two states 2 bytes in 8-bit, 8 in
  32-bit; Lion's one 1 and 4), an upper bound;
* activation offload (torchtune's ``OffloadActivations``: saved tensors to pinned host memory on a
  side stream, back before their backward): the offloaded bytes out and back over PCIe per
  micro-batch, overlapped with compute; only what exceeds the compute time counts;
* fine-tuning (``finetune``): frozen weights compute no weight gradient, so their matmuls cost
  4·N FLOPs per token instead of 6·N; adapters cost 6 FLOPs per adapter parameter per token;
  gradients, their all-reduce and the optimizer step cover the trainable parameters only.

Not modelled (zero cost here): the loss kernel (chunked or fused CE), the optimizer step on the GPU
(fused or foreach, 8-bit or 4-bit states), and QLoRA's 4-bit dequantization before each matmul.

A group whose ranks fit in one node uses the intra-node bandwidth, else the inter-node one.
Ranks are laid out tp (innermost), cp, dp, pp (outermost), as Megatron-LM does.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from trainmem.errors import SpecError
from trainmem.estimate.float8 import converted_parameters
from trainmem.estimate.fsdp_offload import cpu_offload
from trainmem.estimate.params import parameter_shapes
from trainmem.estimate.state_items import BNB
from trainmem.inventory import dtype_bytes
from trainmem.names import is_embedding
from trainmem.plan.hardware import GPU
from trainmem.specs import ImplSpec, ModelSpec, ParallelSpec, StepSpec
from trainmem import validate as v

__all__ = ["CostModel", "StepTime", "step_time", "matmul_parameters", "trainable_parameters",
           "op_recomputed_parameters"]


@dataclass(frozen=True, kw_only=True)
class CostModel:
    """Assumptions of the step-time model (each a documented constant, overridable)."""

    mfu: float = 0.45
    """Share of the dense bf16 peak that large GEMMs reach."""
    min_gemm_rows: int = 1024
    """Local GEMM rows (micro-batch × local sequence) below which throughput falls proportionally."""
    eager_attention_slowdown: float = 4.0
    """Materialized-softmax attention runs its score FLOPs this many times slower than fused kernels."""
    cpu_adam_params_per_s: float = 2e9
    """Parameters per second a CPU Adam step updates (DeepSpeed CPUAdam order of magnitude)."""

    def __post_init__(self) -> None:
        if not 0 < self.mfu <= 1:
            raise SpecError("mfu", self.mfu, "must be in (0, 1]")
        v.positive("min_gemm_rows", self.min_gemm_rows)
        for name in ("eager_attention_slowdown", "cpu_adam_params_per_s"):
            if not getattr(self, name) > 0:
                raise SpecError(name, getattr(self, name), "must be positive")


@dataclass(frozen=True)
class StepTime:
    """Seconds per optimizer step, by part."""

    compute_s: float
    tp_s: float
    cp_s: float
    pp_s: float
    bubble_s: float
    dp_exposed_s: float
    offload_s: float

    @property
    def total_s(self) -> float:
        return (self.compute_s + self.tp_s + self.cp_s + self.pp_s + self.bubble_s
                + self.dp_exposed_s + self.offload_s)

    def to_dict(self) -> dict:
        return {"compute_s": self.compute_s, "tp_s": self.tp_s, "cp_s": self.cp_s, "pp_s": self.pp_s,
                "bubble_s": self.bubble_s, "dp_exposed_s": self.dp_exposed_s, "offload_s": self.offload_s,
                "total_s": self.total_s}


def _counts(model: ModelSpec, shapes) -> list[tuple[str, int, int]]:
    """(name, elements, elements taking part in a matmul per token) of each parameter: the input
    embedding takes part in none unless tied to the head; MoE experts count top_k/num_experts."""
    out = []
    for name, shape in shapes:
        n = 1
        for d in shape:
            n *= d
        mm = n
        if is_embedding(name) and not model.tied_embeddings:
            mm = 0
        elif model.is_moe and "experts" in name and "shared" not in name:
            mm = n * model.top_k // model.num_experts
        out.append((name, n, mm))
    return out


def matmul_parameters(model: ModelSpec) -> tuple[int, int]:
    """(parameters in matmuls, all parameters). MoE experts count top_k/num_experts of theirs."""
    counts = _counts(model, parameter_shapes(model))
    return sum(mm for _, _, mm in counts), sum(n for _, n, _ in counts)


@lru_cache(maxsize=64)
def trainable_parameters(model: ModelSpec, finetune) -> tuple[int, int, int]:
    """(frozen parameters in matmuls, trainable parameters in matmuls, all trainable parameters)
    under ``finetune`` (a FinetuneSpec; adapters count as trainable matmul parameters), counted as
    :func:`matmul_parameters` counts them."""
    from trainmem.estimate.finetune import adapter_parameters, trainable_predicate

    trainable = trainable_predicate(model, finetune)
    shapes = list(parameter_shapes(model))
    if finetune.adapters:
        shapes += [(name, shape) for name, shape, _ in adapter_parameters(model, finetune)]
    frozen_mm = train_mm = train_all = 0
    for name, n, mm in _counts(model, shapes):
        if trainable(name):
            train_all, train_mm = train_all + n, train_mm + mm
        else:
            frozen_mm += mm
    return frozen_mm, train_mm, train_all


def op_recomputed_parameters(model: ModelSpec) -> int:
    """Weights per block whose matmul op-level checkpointing runs again in backward: torchtitan's
    policy (``trainmem.estimate.graph.OpPolicy``) recomputes the 2nd, 4th... aten.mm of the block;
    linears with a bias run addmm, which it keeps. The attention kernels and bmm's are kept too;
    the pointwise ops it recomputes are not priced (like full recompute's)."""
    from trainmem.estimate.graph import OpPolicy

    H, qs, kvs, F = model.hidden_size, model.q_size, model.kv_size, model.ffn_size
    mlp = [F * H, F * H, H * F] if model.gated else [F * H, H * F]
    experts = 0
    if model.is_moe:  # the router is an mm; routed experts run _grouped_mm, which is not kept
        mlp = [model.num_experts * H]
        experts = (3 if model.gated else 2) * model.expert_ffn_size * H * model.top_k
    block = [(qs * H, model.qkv_bias), (kvs * H, model.qkv_bias), (kvs * H, model.qkv_bias),
             (H * qs, model.out_bias), *((w, model.mlp_bias) for w in mlp)]
    policy = OpPolicy()
    return experts + sum(w for w, bias in block if not policy.save("addmm" if bias else "mm"))


#: paged state bytes per trainable parameter, read off estimate/state_items.py's BNB layouts: state1
#: (``copies`` times over) and state2 when there is one, uint8 or fp32 each; absmax is not paged.
#: paged-adamw8bit 2, paged-adamw32bit 8, paged-lion8bit 1, paged-lion32bit 4
_PAGED_STATE_BYTES = {name: (states - 1 + copies) * bits // 8
                      for name, (states, bits, paged, copies) in BNB.items() if paged}


def _bw(gpu: GPU, group: int, inner: int) -> float:
    """Bandwidth of a group of ``group`` ranks spaced ``inner`` apart."""
    return gpu.intra_node_bytes_per_s if group * inner <= gpu.gpus_per_node else gpu.inter_node_bytes_per_s


def step_time(model: ModelSpec, step: StepSpec, impl: ImplSpec, parallel: ParallelSpec, gpu: GPU,
              *, global_batch: int, cost: CostModel = CostModel(), n_params: tuple[int, int] | None = None,
              finetune=None, offloaded_activation_bytes: int = 0) -> StepTime:
    """Estimated time of one optimizer step: ``global_batch`` sequences of ``step.seq`` tokens,
    micro-batch ``step.batch``, spread over ``parallel``. ``finetune``: a FinetuneSpec (frozen
    weights, adapters); ``offloaded_activation_bytes``: what one rank sends to host memory per
    micro-batch under activation offload."""
    p = parallel
    world = p.world_size
    N, N_all = n_params or matmul_parameters(model)
    N_train_all = N_all
    if finetune is not None:
        frozen, train, N_train_all = trainable_parameters(model, finetune)
    L, S, B = model.num_layers, step.seq, step.batch
    qd = model.q_size
    tokens = global_batch * S
    causal = 0.5 if model.arch == "decoder" else 1.0
    attn_fwd_tok = 4 * L * S * qd * causal  # QK^T and PV, per token
    mm_flops = 6 * N * tokens
    if finetune is not None:
        mm_flops = (4 * frozen + 6 * train) * tokens
        N = frozen + train  # what full recompute runs forward again
    attn_flops = 3 * attn_fwd_tok * tokens
    if impl.recompute == "full":
        mm_flops += 2 * N * tokens
        attn_flops += attn_fwd_tok * tokens
    elif impl.recompute == "selective":
        attn_flops += attn_fwd_tok * tokens
    elif impl.recompute == "op":
        mm_flops += 2 * L * op_recomputed_parameters(model) * tokens
    elif impl.recompute == "every-k":
        share = sum(impl.checkpointed(i) for i in range(L)) / L  # floor(L/k) blocks under torchtitan's count
        mm_flops += 2 * N * tokens * share
        attn_flops += attn_fwd_tok * tokens * share
    rate = gpu.bf16_flops * cost.mfu
    rows = B * S / p.cp
    eff = min(1.0, rows / cost.min_gemm_rows)
    attn_slow = cost.eager_attention_slowdown if impl.attention in ("eager", "sdpa-math") else 1.0
    # Float8 (estimate/float8.py): the converted linears' matmuls run at the preset's FP8 rate, same MFU;
    # the casts to fp8 are not priced (torchtitan compiles them into the neighbouring kernels)
    fp8_share = (converted_parameters(model) / N if impl.float8 != "none" and gpu.fp8_flops and N else 0.0)
    mm_flops *= 1 - fp8_share + fp8_share * gpu.bf16_flops / (gpu.fp8_flops or gpu.bf16_flops)
    compute = (mm_flops / eff + attn_flops * attn_slow) / (world * rate)

    act_b = dtype_bytes(step.dtypes.activation)
    micro = global_batch // (B * p.dp)  # micro-batches per rank per step
    layers = -(-L // p.pp)
    local = B * (S / p.cp) * model.hidden_size * act_b  # one B·S·H activation on a rank
    tp = 0.0
    if p.tp > 1:
        per_block = 4 + (2 if impl.recompute == "full" else 0)
        vol = micro * layers * per_block * 2 * (p.tp - 1) / p.tp * local
        tp = vol / _bw(gpu, p.tp, 1)
    cp = 0.0
    if p.cp > 1:
        kv = B * (S / p.cp) * model.kv_size * act_b / p.tp  # K or V chunk
        vol = micro * layers * (p.cp - 1) * (2 * kv + 4 * kv)
        cp = vol / _bw(gpu, p.cp, p.tp)
    pp = bubble = 0.0
    if p.pp > 1:
        pp = 2 * micro * local / p.tp / _bw(gpu, p.pp, p.tp * p.cp * p.dp)
        bubble = (compute + tp + cp + pp) * (p.pp - 1) / micro

    # model states one rank holds a replica slice of: N_all / (tp · pp) parameters
    shard_params = N_all / (p.tp * p.pp)
    shard_train = N_train_all / (p.tp * p.pp)
    gb = dtype_bytes(step.dtypes.grad)
    pb = dtype_bytes(step.dtypes.param)
    d = p.dp * p.cp
    zero = 3 if p.fsdp is not None else p.zero
    dp = 0.0
    if d > 1:
        ring = (d - 1) / d
        if zero <= 1:
            vol = 2 * ring * shard_train * gb
        elif zero == 2:
            vol = micro * ring * shard_train * gb + ring * shard_train * pb
        else:
            vol = micro * ring * (shard_train * gb + shard_params * 2 * pb)
        dp = vol / _bw(gpu, d, p.tp)
    dp_exposed = max(0.0, dp - compute)
    offload = 0.0
    if cpu_offload(p):  # FSDP's CPUOffloadPolicy (estimate/fsdp_offload.py): each micro-batch's gradient
        # shards to the host, Adam on the CPU; the shards' copies to each all-gather are the params term below
        shard = shard_train / d
        offload = micro * shard * gb / gpu.host_bytes_per_s + shard / cost.cpu_adam_params_per_s
    elif "optimizer" in p.offload:
        shard = shard_train / (d if zero >= 1 else 1)
        offload = shard * (gb + pb) / gpu.host_bytes_per_s + shard / cost.cpu_adam_params_per_s
    paged = _PAGED_STATE_BYTES.get(step.optimizer, 0)
    if paged:
        offload += 2 * shard_train / (d if zero >= 1 else 1) * paged / gpu.host_bytes_per_s
    if "params" in p.offload:
        shard = shard_params / (d if zero >= 3 else 1)
        offload += 2 * micro * shard * pb / gpu.host_bytes_per_s
    if offloaded_activation_bytes:
        out_and_back = 2 * micro * offloaded_activation_bytes / gpu.host_bytes_per_s
        offload += max(0.0, out_and_back - compute)
    return StepTime(compute, tp, cp, pp, bubble, dp_exposed, offload)
