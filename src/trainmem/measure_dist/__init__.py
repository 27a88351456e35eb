"""Per-rank memory of real torch.distributed training steps (gloo, CPU), for checking the
parallel estimator: DDP, FSDP2 ``fully_shard``, DTensor tensor/sequence parallel and
``torch.distributed.pipelining``. See ``docs/parallel.md``.

>>> from trainmem.measure_dist import run_torchrun
>>> ranks = run_torchrun(2, {"strategy": "ddp"})  # doctest: +SKIP
>>> ranks[0]["states_bytes"]["parameter"]  # doctest: +SKIP
"""

from trainmem.measure_dist.launch import DistributedRunError, run_torchrun

__all__ = ["DistributedRunError", "run_torchrun"]
