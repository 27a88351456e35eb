"""The rank-local model and step: tensor parallelism divides heads, FFN width and vocabulary by
``tp`` (:func:`apply_tp`), context parallelism the sequence by ``cp`` (:func:`apply_cp`), and
:func:`_tp_factor` gives the divisor of each model state by name: column-, row- and vocab-parallel
weights (every family's roles, ``trainmem/families/``) by ``tp``, experts by ``ep``.
"""

from __future__ import annotations

from dataclasses import replace
from functools import lru_cache

from trainmem.families import tp_roles
from trainmem.specs import ImplSpec, ModelSpec, ParallelSpec, StepSpec

__all__ = ["apply_tp", "apply_cp", "tp_node_moments"]


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


def apply_cp(step: StepSpec, par: ParallelSpec) -> StepSpec:
    """The step one CP rank computes: the sequence divided by ``cp``."""
    return step if par.cp == 1 else replace(step, seq=step.seq // par.cp)


def apply_tp(model: ModelSpec, par: ParallelSpec) -> ModelSpec:
    """The model one TP rank computes: heads, FFN width and vocabulary divided by ``tp``."""
    t = par.tp
    if t == 1:
        return model
    return replace(model, num_heads=model.num_heads // t, num_kv_heads=model.num_kv_heads // t,
                   head_dim=model.head_dim, ffn_size=model.ffn_size // t,
                   vocab_size=-(-model.vocab_size // t),
                   expert_ffn_size=model.expert_ffn_size // t if model.is_moe and par.ep == 1 else model.expert_ffn_size)


def tp_node_moments(par: ParallelSpec, impl: ImplSpec) -> bool:
    """Whether a tensor-parallel rank's checkpointed blocks take their node moments (estimate/block_backward.py,
    on the TP-local recomputed set) as one device's do, instead of the generic block working set alone.

    Under ``--recompute full`` the first block's backward peaks inside its MLP product's backward (the ``mul`` of
    ``act_fn(gate) * up``), as on one device: DTensor's colwise/rowwise plan shards the recomputed tensors but
    adds none to that moment: the down projection's weight gradient exists there, beside three [B,S,F/tp]
    tensors (the down projection's input gradient, the product's two gradients) and two [B,S,H] (the residual's
    gradient, the rowwise output's). The generic working set (recomputed block + output gradient + the largest
    tensor's one gradient) leaves the weight gradient and two of those out and read under the trace: tiny Llama H64 F176 L4 B2 S64 tp2, fp32 -34,824 B (no sp) and -51,208 B (sp + loss_parallel),
    bf16 sp -25,608 B; with the node moments all equal the fake-PG trace (trace/parallel_tp.py). Pure TP only
    (no dp/cp/pp/FSDP beside it: those stages are not measured with moments), torch's engine (the caller
    checks), full recompute (what was measured; ``--profile traced`` too, on its template traced without
    checkpointing), eager (compiled TP: estimate/compiled_recompute.py's moments, not these); amp-bf16 sp
    stays 9,216 B under (peak at autocast's bf16 copy in the rowwise down projection's backward, not modelled)."""
    return (par.tp > 1 and par.pp == 1 and par.dp * par.cp == 1 and not par.fsdp and impl.recompute == "full"
            and not impl.compile)
