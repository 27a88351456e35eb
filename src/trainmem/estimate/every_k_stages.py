"""``--recompute every-k`` under pipeline parallelism: which blocks a rank checkpoints.

torchtitan applies activation checkpointing to each rank's own model part after the pipeline split
(``distributed/activation_checkpoint.py`` ``apply_ac`` over ``model.layers``, the stage's blocks only) and
``_apply_layer_sac`` counts the blocks it wraps with a process-global counter: the k-th, 2k-th... block the
rank builds, counted across its virtual stages in the order they are built. ``ImplSpec.checkpointed`` counts
the model's blocks from the first, so the two agree only where every count a rank starts falls on a multiple
of k: each stage's first block (1F1B, GPipe) and, interleaved, each virtual stage's size (the count runs on
across a rank's stages). Elsewhere the estimate would checkpoint other blocks than torchtitan does: refused,
naming ``recompute_every``, rather than priced on the wrong blocks."""

from __future__ import annotations

from trainmem.errors import SpecError
from trainmem.specs import ImplSpec, ModelSpec, ParallelSpec

__all__ = ["check_every_k_stages"]


def check_every_k_stages(model: ModelSpec, impl: ImplSpec, par: ParallelSpec) -> None:
    """Refuse ``every-k`` under ``pp`` where a rank's own count would checkpoint other blocks."""
    if impl.recompute != "every-k" or par.pp == 1:
        return
    from trainmem.estimate.parallel_pp import stage_layers

    k = impl.recompute_every
    starts = [a for a, _ in stage_layers(model, par)]
    sizes = [b - a for a, b in stage_layers(model, par)]
    chunks = ([n // par.virtual_stages for n in sizes] if par.schedule == "interleaved" else [])
    if any(a % k for a in starts) or any(c % k for c in chunks):
        raise SpecError("recompute_every", k, f"under pp={par.pp} ({par.schedule}) torchtitan counts each rank's own "
                        f"blocks (stages start at {starts}"
                        + (f", virtual stages of {sorted(set(chunks))}" if chunks else "")
                        + f"): modelled where k divides each count's start; use a k dividing them or --recompute full")
