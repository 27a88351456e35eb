"""The measured torchrun scenarios, launched once per test session (imports dominate a launch).

Two launches: 2 ranks run every strategy in one process group, 4 ranks run FSDP2. Each result
is one rank's measurement (``trainmem.measure_dist.worker``).
"""

from __future__ import annotations

import functools

from trainmem.measure_dist.launch import run_torchrun_many
from trainmem.measure_dist.worker import DEFAULTS

CONFIG = DEFAULTS["config"]
B, S = DEFAULTS["batch"], DEFAULTS["seq"]
MICROBATCHES = DEFAULTS["microbatches"]

SCENARIOS_2 = {
    "single": dict(strategy="single"),
    "ddp": dict(strategy="ddp"),
    "ddp-bucket-view": dict(strategy="ddp", gradient_as_bucket_view=True),
    "fsdp2-reshard": dict(strategy="fsdp", reshard_after_forward=True),
    "fsdp2-keep": dict(strategy="fsdp", reshard_after_forward=False),
    "tp2": dict(strategy="tp", sp=False),
    "tp2-sp": dict(strategy="tp", sp=True),
    "pp2-gpipe": dict(strategy="pp", schedule="gpipe", microbatches=MICROBATCHES),
    "pp2-1f1b": dict(strategy="pp", schedule="1f1b", microbatches=MICROBATCHES),
}
SCENARIOS_4 = {
    "fsdp4-reshard": dict(strategy="fsdp", reshard_after_forward=True),
    "fsdp4-keep": dict(strategy="fsdp", reshard_after_forward=False),
}
WORLD = {**{k: 2 for k in SCENARIOS_2}, **{k: 4 for k in SCENARIOS_4}}


@functools.lru_cache(maxsize=None)
def _launch(nproc: int) -> dict[str, list[dict]]:
    table = SCENARIOS_2 if nproc == 2 else SCENARIOS_4
    results = run_torchrun_many(nproc, list(table.values()), timeout=240)
    return dict(zip(table, results))


def measured(name: str) -> list[dict]:
    """Per-rank results of scenario ``name``, sorted by rank."""
    return _launch(WORLD[name])[name]
