"""GPU tests (``@pytest.mark.gpu``) are skipped when torch sees no CUDA device; torchrun tests
(``@pytest.mark.distributed``, ~25 s on two CPU cores) run by default, as in tests/parallel, and
can be skipped with TRAINMEM_DISTRIBUTED=0 for a quick local run."""

import os
from pathlib import Path

import pytest


def pytest_collection_modifyitems(config, items):
    try:
        import torch
        has_cuda = torch.cuda.is_available()
    except ImportError:
        has_cuda = False
    here = Path(__file__).parent
    no_gpu = pytest.mark.skip(reason="needs a CUDA device")
    no_dist = pytest.mark.skip(reason="launches torchrun: skipped by TRAINMEM_DISTRIBUTED=0")
    for item in items:
        if not item.path.is_relative_to(here):
            continue
        if "gpu" in item.keywords and not has_cuda:
            item.add_marker(no_gpu)
        if "distributed" in item.keywords and os.environ.get("TRAINMEM_DISTRIBUTED") == "0":
            item.add_marker(no_dist)
