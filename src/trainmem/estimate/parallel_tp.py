"""The rank-local model and step: tensor parallelism divides heads, FFN width and vocabulary by
``tp`` (:func:`apply_tp`), context parallelism the sequence by ``cp`` (:func:`apply_cp`), and
:func:`_tp_factor` gives the divisor of each model state by name: column-, row- and vocab-parallel
weights (every family's roles, ``trainmem/families/``) by ``tp``, experts by ``ep``.
"""

from __future__ import annotations

from dataclasses import replace
from functools import lru_cache

from trainmem.families import tp_roles
from trainmem.specs import ModelSpec, ParallelSpec, StepSpec

__all__ = ["apply_tp", "apply_cp"]


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
