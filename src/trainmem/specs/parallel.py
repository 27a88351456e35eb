"""ParallelSpec: how a step is spread over ranks (data, tensor, sequence, context, expert,
pipeline parallelism; ZeRO/FSDP; offload)."""

from __future__ import annotations

from dataclasses import dataclass, fields

from trainmem.errors import SpecError
from trainmem import validate as v

__all__ = ["ParallelSpec", "SCHEDULES", "OFFLOADS"]

SCHEDULES = ("gpipe", "1f1b", "interleaved", "zero-bubble")
OFFLOADS = ("optimizer", "params", "activations")


@dataclass(frozen=True, kw_only=True)
class ParallelSpec:
    """Parallel degrees and sharding. The world size is dp × tp × cp × pp (ep divides dp·cp... see docs)."""

    dp: int = 1
    """Data-parallel replicas (also the ZeRO/FSDP sharding group unless ``fsdp='hybrid'``)."""
    tp: int = 1
    """Tensor-parallel degree (splits heads and the FFN width)."""
    sp: bool = False
    """Sequence parallelism on top of TP: norms, dropout and residuals split over tokens."""
    cp: int = 1
    """Context-parallel degree (splits the sequence for attention)."""
    cp_style: str = "ring"
    """``ring`` (K/V blocks passed around) or ``allgather`` (K/V gathered once)."""
    ep: int = 1
    """Expert-parallel degree (MoE experts split over ranks)."""
    pp: int = 1
    """Pipeline stages."""
    schedule: str = "1f1b"
    """gpipe, 1f1b, interleaved (with ``virtual_stages``), zero-bubble."""
    virtual_stages: int = 1
    """Model chunks per pipeline rank for the interleaved schedule."""
    microbatches: int = 1
    """Micro-batches per pipeline flush (the step's gradient accumulation under PP)."""
    zero: int = 0
    """ZeRO stage 0-3 (1: optimizer states, 2: + gradients, 3: + parameters sharded over dp)."""
    fsdp: str | None = None
    """FSDP sharding: ``full`` (= ZeRO-3) or ``hybrid`` (shard within a node, replicate across)."""
    fsdp_group: int = 8
    """Ranks per shard group for hybrid sharding."""
    reshard_after_forward: bool = True
    """FSDP frees gathered parameters after forward (False keeps them until backward)."""
    fsdp_version: int = 2
    """FSDP2 (``fully_shard``: per-parameter shards) or FSDP1 (``FullyShardedDataParallel`` with
    ``use_orig_params=True``: one padded FlatParameter per wrapped block, estimate/fsdp.py)."""
    fsdp_units: str = "blocks"
    """FSDP2 units: ``blocks`` (each block; the root keeps the embedding and head, gathered all
    step) or ``blocks+embed+head`` (the token embedding and the final norm + output layer as
    their own units, gathered only around their use: torchtitan, torchtune's
    ``custom_sharded_layers``; estimate/fsdp_units.py)."""
    offload: tuple[str, ...] = ()
    """What lives in host memory: optimizer, params, activations."""
    layer_split: tuple[int, ...] = ()
    """Layers per pipeline stage when uneven (must sum to the model's layers)."""
    loss_parallel: bool = True
    """Under TP the logits stay vocab-sharded (V/tp per rank) and cross-entropy runs on the sharded
    DTensor (``torch.distributed.tensor.parallel.loss_parallel``, torchtitan's default); False
    all-gathers the full-vocabulary logits on every rank first (torchtitan's
    ``disable_loss_parallel``, Hugging Face's ``colwise_gather_output`` head): estimate/loss_parallel.py."""

    def __post_init__(self) -> None:
        for name in ("dp", "tp", "cp", "ep", "pp", "virtual_stages", "microbatches", "fsdp_group"):
            v.positive(name, getattr(self, name), maximum=1 << 20)
        v.boolean("sp", self.sp)
        v.boolean("reshard_after_forward", self.reshard_after_forward)
        v.boolean("loss_parallel", self.loss_parallel)
        v.one_of("schedule", self.schedule, SCHEDULES)
        v.one_of("cp_style", self.cp_style, ("ring", "allgather"))
        if self.zero not in (0, 1, 2, 3):
            raise SpecError("zero", self.zero, "must be 0, 1, 2 or 3")
        if self.fsdp is not None:
            v.one_of("fsdp", self.fsdp, ("full", "hybrid"))
        if self.fsdp_version not in (1, 2) or isinstance(self.fsdp_version, bool):
            raise SpecError("fsdp_version", self.fsdp_version, "must be 1 or 2")
        if self.fsdp_version == 1 and self.fsdp is None:
            raise SpecError("fsdp_version", 1, "needs fsdp (full or hybrid)")
        v.one_of("fsdp_units", self.fsdp_units, ("blocks", "blocks+embed+head"))
        if self.fsdp_units != "blocks" and (self.fsdp is None or self.fsdp_version != 2):
            raise SpecError("fsdp_units", self.fsdp_units, "needs FSDP2 (fsdp full or hybrid, fsdp_version 2)")
        object.__setattr__(self, "offload", tuple(self.offload))
        for o in self.offload:
            v.one_of("offload", o, OFFLOADS)
        if self.sp and self.tp == 1:
            raise SpecError("sp", self.sp, "sequence parallelism needs tp > 1")
        if self.virtual_stages > 1 and self.schedule != "interleaved":
            raise SpecError("virtual_stages", self.virtual_stages, f"needs schedule='interleaved', not {self.schedule!r}")

    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.cp * self.pp

    @property
    def is_single(self) -> bool:
        return (self.world_size == 1 and self.ep == 1 and not self.offload and self.zero == 0
                and self.fsdp is None)

    def to_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}
