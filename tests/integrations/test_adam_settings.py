"""Adam's and AdamW's settings that add a state or a temporary trainmem does not model are refused on a live
optimizer (what the Trainer or a callback hands over), in one line; the settings that add nothing pass."""

from __future__ import annotations

import pytest

from trainmem.errors import UnsupportedError
from trainmem.integrations.read import optimizer_of

torch = pytest.importorskip("torch")


def _params():
    return [torch.nn.Parameter(torch.zeros(8, 8))]


@pytest.mark.parametrize("cls, kwargs, message", [
    ("AdamW", {"amsgrad": True}, "amsgrad=True: torch's AdamW then holds a state per tensor"),
    ("Adam", {"maximize": True}, "maximize=True: torch's Adam then holds a gradient-sized temporary"),
    ("Adam", {"weight_decay": 0.01}, "weight_decay=0.01: torch's Adam then holds a gradient-sized temporary"),
])
def test_unmodelled_adam_settings_are_refused(cls, kwargs, message):
    opt = getattr(torch.optim, cls)(_params(), **kwargs)
    with pytest.raises(UnsupportedError) as e:
        optimizer_of(opt, device="cpu")
    assert message in str(e.value) and "\n" not in str(e.value)


def test_adamw_weight_decay_is_in_place_and_read():
    """AdamW's decoupled weight decay is ``param.mul_(1 - lr * wd)``: nothing more to hold."""
    read = optimizer_of(torch.optim.AdamW(_params(), weight_decay=0.1), device="cpu")
    assert read.value[0] == "adamw"
