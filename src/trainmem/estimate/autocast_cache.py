"""Autocast's weight-cast cache: the low-precision weight copies held to the end of the forward.

Under ``torch.autocast`` a linear's weight is cast once per autocast region and kept in a cache
(``aten/src/ATen/autocast_mode.cpp`` ``cached_cast``: only for a leaf tensor that requires grad, and
only while caching is on), which ``torch.autocast.__exit__`` clears when the outermost region ends
(``torch/amp/autocast_mode.py``: ``torch.clear_autocast_cache()``). The HF Trainer and trainmem's trace
wrap the forward and the loss in autocast and run backward outside it, so every trainable weight's
copy lives until the loss is made. Without recompute the linears save those copies anyway (they are
activations); a checkpointed block saves none of them, but the cache still holds them through the
forward: the forward phase's ``autocast_weight_cache``.

Known limitations: fine-tuning (a frozen weight is not cached, an adapter's is) and the parallel
layouts (FSDP's unsharded weights, DTensor) are not modelled; compile keeps the casts inside its regions.
"""

from __future__ import annotations

from trainmem.inventory import Inventory

__all__ = ["autocast_cached_casts", "autocast_head_input"]

_CAST = ".weight_cast"  # the HF rules' name of a linear's autocast weight copy (estimate/ctx.py cast)


def autocast_cached_casts(saved: Inventory, recomputed: Inventory | None) -> int:
    """Bytes of the weight copies the cache holds that the saved set does not already count: those a
    recomputed (checkpointed) block made in its forward. 0 without recompute."""
    if recomputed is None:
        return 0
    def casts(inv: Inventory) -> int:
        return sum(i.bytes for i in inv if i.name.endswith(_CAST))
    return casts(recomputed) - casts(saved)


def autocast_head_input(saved: Inventory) -> int:
    """Under autocast the LM head reads a cast of the final norm's output (``lm_head.input_cast``); the
    output itself (the model output's ``last_hidden_state``, in the weights' dtype) is saved by no one but
    stays alive until the forward returns, after the loss (transformers ``LlamaForCausalLM.forward``:
    ``outputs`` is held while ``self.loss_function`` runs). Its bytes: 0 when the head keeps its input."""
    cast = next((i for i in saved if i.name == "lm_head.input_cast"), None)
    normed = next((i for i in saved if i.name == "model.norm.normed"), None)
    return normed.bytes if cast is not None and normed is not None else 0


# --- one autocast around the whole pipeline schedule ---------------------------------------------------------
#
# torchtitan's train step and trainmem's trace (trace/step.py ``one_step``) run ``schedule.step()``, every
# micro-batch's forward and backward (torch/distributed/pipelining/schedules.py ``ScheduleGPipe._step_microbatches``,
# ``Schedule1F1B._step_microbatches``), inside ONE ``torch.autocast``. Its cast cache
# (aten/src/ATen/autocast_mode.cpp ``cached_cast``: a leaf that requires grad, keyed by its TensorImpl) is
# emptied only when that outermost region exits, after the step's last backward: the first micro-batch's
# forward casts each stage weight once, every later micro-batch (and a checkpointed block's recompute, its own
# autocast nested inside) reuses the copy, and no node's release frees it.

_CACHE_NOTE = "autocast's cast cache (buffers.autocast_weight_cache)"
CACHE_PHASES = ("forward", "backward_start", "backward", "backward_first_block", "backward_end")
_BOUNDARY = ("pp_recv_activations", "pp_recv_gradients", "pp_stage_outputs", "pp_sent_input_grads")


def schedule_caches_casts(*, pp: int, autocast: bool, torch_engine: bool) -> bool:
    """Whether a pipeline rank's weight copies are the schedule-long cache's (above), not its micro-batches'."""
    return pp > 1 and autocast and torch_engine


def without_weight_casts(items) -> tuple:
    """``items`` with each weight copy given as what it is under the schedule's autocast: the cache's, 0 bytes
    here (one micro-batch's saved set, multiplied by the micro-batches in flight, and a checkpointed block's
    recomputed set no longer count it); :func:`cache_bytes` counts it once."""
    from trainmem.inventory import MemoryItem
    out = []
    for it in items:
        if it.name.endswith(_CAST):
            it = MemoryItem.make(it.name, it.category, it.shape, it.dtype, 0, "0", it.dims, it.key)
            it.__dict__["note"] = _CACHE_NOTE
        out.append(it)
    return tuple(out)


def stage_copies(items, stage_of, stage: int, biases) -> list[tuple[str, int]]:
    """The cache on stage ``stage``, one entry per linear in forward order: (its name, the bytes of its weight copy
    and of its bias copy). ``items``: the uncheckpointed set, as a recompute would make it (``stage_of``: each
    item's stage); ``biases``: :func:`bias_copies`. A linear's bias is cast beside its weight (``addmm``'s
    operands) and cached alike, never saved (its gradient reads no operand)."""
    return [(lin := it.name.removesuffix(_CAST), it.bytes + biases.get(lin, 0))
            for it, st in zip(items, stage_of) if st == stage and it.name.endswith(_CAST)]


def bias_copies(states, low_bytes: int) -> dict[str, int]:
    """Each trainable bias's low-precision copy, by its module (``states``: the model states)."""
    from trainmem.inventory import Category, dtype_bytes
    grads = {i.name.removesuffix(".grad") for i in states if i.category is Category.GRADIENT}
    return {i.name.removesuffix(".bias"): i.bytes // dtype_bytes(i.dtype) * low_bytes for i in states
            if i.category is Category.PARAMETER and i.name.endswith(".bias") and i.name in grads}


def with_cache(working: dict, cached: int, *, compute_bytes: int, activation_bytes: int) -> None:
    """``working`` (per phase, in place) with the cache alive from the first forward to the end of the last
    backward, and the stage boundary (receive buffers, stage outputs, sent gradients) in the residual stream's
    dtype: the blocks' residual adds run in the weights' dtype under autocast (fp32), not the cast one."""
    for ph in CACHE_PHASES:
        working.setdefault(ph, {})["autocast_weight_cache"] = cached
    for parts in working.values():
        for k in _BOUNDARY:
            if k in parts:
                parts[k] = parts[k] * compute_bytes // activation_bytes


def deferred_cast_grads(copies: list[tuple[str, int]], first_layer: int, last_layer: int) -> dict[str, int]:
    """The bf16 weight (and bias) gradients a later micro-batch's backward holds, per backward phase (``working``'s
    keys); ``copies``: the stage's :func:`stage_copies`, its blocks ``[first_layer, last_layer)``.

    A cached copy's ``ToCopyBackward0`` was made by the first micro-batch's forward, so in a later micro-batch's
    graph it has the lowest sequence number of all and the engine's ready queue (torch/csrc/autograd/engine.cpp
    ``CompareNodeTaskTime``: the higher ``sequence_nr`` first) runs it only when nothing else is ready, at the
    end of the stage's backward: each linear's bf16 weight gradient (``MmBackward0``'s ``grad.T @ x``, the
    copy's size) stays alive from its linear's node to there. At the last block's moment (its MLP's, after the
    down projection's node: estimate/block_backward.py ``_gated_mlp``) the head's and that projection's are
    alive; at the first block's, every later block's too."""
    from trainmem.names import layer_index

    def block(li: int) -> list[int]:
        return [b for name, b in copies if layer_index(name) == li]

    head = sum(b for name, b in copies if layer_index(name) is None)
    last = block(last_layer - 1)
    out = {"backward": head + (last[-1] if last else 0)}
    if last_layer - first_layer > 1:
        first = block(first_layer)
        out["backward_first_block"] = head + sum(sum(block(li)) for li in range(first_layer + 1, last_layer)) + (
            first[-1] if first else 0)
    return {k: v for k, v in out.items() if v}


def check_schedule_autocast(model, step, impl, par, finetune=None) -> None:
    """Refuse an autocast precision under pipeline stages outside what was measured equal to the trace per rank
    (tests/estimate/test_pp_autocast.py: tiny Llama, sdpa, pp 2, 4 micro-batches): torch.distributed.pipelining's
    1F1B with ``--recompute`` none or full and GPipe with full, eager, one rank per stage, no linear biases (their
    cached copies are not counted per stage), no experts, no accumulation, no fine-tuning. GPipe without recompute
    reads 8,192 B over on rank 0 (the last block's working-set moment, estimate/backward_moments.py, counts the
    received output gradient once more; its node moment equals the trace); eager attention up to 1.5% off (as are
    its bf16 and fp32 stages: bf16 1F1B rank 0 +57,344 B)."""
    from trainmem.errors import UnsupportedError
    if par.pp == 1 or not step.dtypes.autocast:
        return
    why = [k for k, bad in (
        (f"schedule={par.schedule!r} recompute={impl.recompute!r}",
         (par.schedule, impl.recompute) not in (("1f1b", "none"), ("1f1b", "full"), ("gpipe", "full"))),
        (f"attention={impl.attention!r}", impl.attention != "sdpa"),
        (f"profile={impl.profile!r}", impl.profile != "hf"), (f"framework={impl.framework!r}", impl.framework != "hf"),
        ("compile", impl.compile), ("fused kernels", impl.fused_norm or impl.fused_bias_act or impl.fused_dropout
                                    or impl.inplace_act),
        ("float8", impl.float8 != "none"), ("optimizer_in_backward", impl.optimizer_in_backward),
        (f"dp={par.dp} tp={par.tp} cp={par.cp} ep={par.ep}", par.dp * par.tp * par.cp * par.ep > 1),
        ("fsdp/zero/offload", bool(par.fsdp or par.zero or par.offload)),
        ("output or MLP biases", model.out_bias or model.mlp_bias), ("experts", model.is_moe),
        (f"grad_accum={step.grad_accum}", step.grad_accum > 1), ("fine-tuning", finetune is not None)) if bad]
    if why:
        raise UnsupportedError(f"precision={step.recipe!r} is not modelled with pp={par.pp} and {', '.join(why)}: "
                               "autocast under pipeline stages is modelled for 1F1B (recompute none or full) and "
                               "GPipe (full), eager sdpa blocks, one rank per stage (docs/parallel.md)")
