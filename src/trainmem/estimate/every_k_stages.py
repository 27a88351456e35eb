"""``--recompute every-k`` under pipeline parallelism: which blocks a rank checkpoints.

torchtitan applies activation checkpointing to each rank's own model parts after the pipeline split
(``distributed/activation_checkpoint.py`` ``apply_ac`` over each part's ``model.layers``) and
``_apply_layer_sac`` counts the blocks it wraps with a module-level counter: the k-th, 2k-th... block the
rank builds, counted across its virtual stages in the order they are built (``ImplSpec.counted_by_ranks``,
``every_k_counts``). :func:`place_every_k` gives an ImplSpec that count (``recompute_counts``) in the
estimate's numbering of the blocks: rank ``s`` holds ``stage_layers(model, par)[s]``, one run of blocks (an
interleaved rank's virtual stages are not numbered apart, and the count runs on across them, so the run's
positions are the rank's). ``recompute_from='first'`` (transformers' ``every_n_layers``) counts the whole model's
blocks instead, before the cut (``ImplSpec.counted_by_ranks``); under interleaved 1F1B its positions are placed per
virtual stage (:func:`_model_positions`). :func:`check_every_k_stages` (``estimate/parallel.py`` ``validate``) refuses an
ImplSpec whose count is not that one, unless the whole model's count checkpoints the same blocks, and, under
interleaved 1F1B, a count that checkpoints other blocks in a rank's different virtual stages: the estimate holds a
rank's virtual stages as equal shares of its blocks (``parallel_pp.py`` ``in_flight``), which they then are not
(tiny Llama L=8, pp=2, v=2, k=3: 6 % under the trace on rank 0; k=2, each virtual stage's second block: 0.998 and
1.004, as without recompute)."""

from __future__ import annotations

from dataclasses import replace

from trainmem.errors import SpecError
from trainmem.specs import ImplSpec, ModelSpec, ParallelSpec

__all__ = ["place_every_k", "check_every_k_stages"]


def place_every_k(model: ModelSpec, impl: ImplSpec, par: ParallelSpec | None) -> ImplSpec:
    """``impl`` with every-k counted over each pipeline rank's blocks (``ImplSpec.recompute_counts``) in the
    estimate's stages; ``impl`` itself without every-k or pipeline stages."""
    if par is None or impl.recompute != "every-k" or par.pp == 1:
        return impl
    from trainmem.estimate.parallel_pp import stage_layers
    runs = stage_layers(model, par)
    if impl.recompute_from == "first" and par.schedule == "interleaved":
        return replace(impl, recompute_counts=_model_positions(runs, par))
    return impl.counted_by_ranks([[stage] for stage in runs], par.pp)


def _model_positions(runs: list[tuple[int, int]], par: ParallelSpec) -> tuple[tuple[int, int], ...]:
    """transformers' whole-model count (``recompute_from='first'``, ``ImplSpec.counted_by_ranks``) in the estimate's
    numbering of an interleaved rank's blocks: rank ``r``'s run of blocks is its virtual stages ``j`` in order, each
    ``n`` blocks, global stage ``r + j·pp`` (torchtitan's ``stage_ids_this_rank``, style "loop"), whose first block is
    the model's ``(r + j·pp)·n``: each virtual stage's first block counts on from there."""
    if par.layer_split:  # the trace refuses it too (trace/parallel_pp.py check_pp_flags): no global stages to read
        raise SpecError("layer_split", par.layer_split, "with --schedule interleaved and --recompute-from first: "
                        "transformers' whole-model count needs the even split's virtual stages")
    v = par.virtual_stages
    return tuple((a + j * ((b - a) // v), (r + j * par.pp) * ((b - a) // v))
                 for r, (a, b) in enumerate(runs) for j in range(v))


def check_every_k_stages(model: ModelSpec, impl: ImplSpec, par: ParallelSpec) -> None:
    """Refuse ``every-k`` whose count is not torchtitan's per rank for ``par`` (:func:`place_every_k`)."""
    if impl.recompute != "every-k":
        return
    if par.pp == 1:
        if impl.recompute_counts:
            raise SpecError("recompute_counts", impl.recompute_counts, "are a pipeline's per-rank count; with pp=1 "
                                                                       "every-k counts the model's blocks: leave it ()")
        return
    placed = place_every_k(model, impl, par)
    _check_virtual_stages(model, placed, par)
    if impl.recompute_counts == placed.recompute_counts:
        return
    if impl.recompute_counts:
        raise SpecError("recompute_counts", impl.recompute_counts, f"are not the per-rank count of pp={par.pp} "
                        f"({par.schedule}), {placed.recompute_counts}: place_every_k(model, impl, parallel) places it")
    L, k = model.num_layers, impl.recompute_every
    if any(impl.checkpointed(i) != placed.checkpointed(i) for i in range(L)):
        starts = [b for b, _ in placed.recompute_counts]
        raise SpecError("recompute_every", k, f"under pp={par.pp} ({par.schedule}) the blocks are counted per rank "
                        f"(kth: torchtitan's count, stages start at {starts}) or per model (first: transformers', "
                        "in the model's numbering): "
                        "estimate.every_k_stages.place_every_k(model, impl, parallel) places that count; or use a k "
                        "dividing each stage's start, or --recompute full")


def _check_virtual_stages(model: ModelSpec, placed: ImplSpec, par: ParallelSpec) -> None:
    """Under interleaved 1F1B, each of a rank's virtual stages must checkpoint the same positions."""
    if par.schedule != "interleaved":
        return
    from trainmem.estimate.parallel_pp import stage_layers

    v = par.virtual_stages
    for a, b in stage_layers(model, par):
        flags = [placed.checkpointed(i) for i in range(a, b)]
        n = (b - a) // v
        if any(flags) and ((b - a) % v or any(flags[j * n:(j + 1) * n] != flags[:n] for j in range(v))):
            raise SpecError("recompute_every", placed.recompute_every,
                            f"under pp={par.pp} interleaved with {v} virtual stages the {placed.recompute_from} count "
                            f"checkpoints other blocks in each (blocks {a}-{b - 1}: "
                            f"{[i for i in range(a, b) if flags[i - a]]}), which the estimate holds as equal shares; "
                            f"use a k dividing each virtual stage's blocks, or --recompute full")
