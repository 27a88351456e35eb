"""GPU tests (``@pytest.mark.gpu``) are skipped when torch sees no CUDA device."""

from pathlib import Path

import pytest


def pytest_collection_modifyitems(config, items):
    try:
        import torch
        has_cuda = torch.cuda.is_available()
    except ImportError:
        has_cuda = False
    if has_cuda:
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords and item.path.is_relative_to(Path(__file__).parent):
            item.add_marker(skip)
