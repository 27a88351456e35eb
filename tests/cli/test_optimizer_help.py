"""--optimizer's help names the library of every optimizer: its patterns per library cover exactly
the names estimate/state_items.py lays out as bitsandbytes' and torchao's, and torch's the rest."""

from __future__ import annotations

import re
from fnmatch import fnmatch

from trainmem.cliargs import OPTIMIZER_HELP
from trainmem.estimate.state_items import BNB, TORCHAO
from trainmem.specs.step import OPTIMIZERS

TORCH_BEFORE = {"adamw", "adam", "sgd", "sgd-momentum", "adafactor"}  # the names the help lists first


def _library(label: str) -> set[str]:
    """The OPTIMIZERS the help assigns to ``label`` ("rmsprop8bit/32bit" names two)."""
    segment = re.search(rf"(?:\(|; )([^;(]*): {re.escape(label)}", OPTIMIZER_HELP).group(1)
    patterns = []
    for pat in segment.split(", "):
        head, _, tail = pat.partition("/")
        patterns += [head, re.sub(r"\d+bit$", tail, head)] if tail else [head]
    return {o for o in OPTIMIZERS if any(fnmatch(o, p) for p in patterns)}


def test_each_library_is_named_for_its_optimizers():
    assert _library("bitsandbytes") == set(BNB)
    assert _library("torchao's low-bit AdamW") == set(TORCHAO)
    assert _library("torch.optim") == {"rmsprop", "adagrad"}
    assert set(OPTIMIZERS) == set(BNB) | set(TORCHAO) | {"rmsprop", "adagrad"} | TORCH_BEFORE


def test_every_name_is_listed():
    assert OPTIMIZER_HELP.startswith(", ".join(OPTIMIZERS) + " (")
