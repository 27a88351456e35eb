"""Item names follow module paths (``model.layers.3.mlp.up_proj.out``); what can be read from one.

Shared by the estimator, the planner and the renderers, so that none of them imports another
to parse a name.
"""

from __future__ import annotations

import re
from functools import lru_cache

__all__ = ["layer_of"]

_LAYER = re.compile(r"\.(?:layers|h|layer)\.(\d+)\.")


@lru_cache(maxsize=1 << 16)
def _layer_of_prefix(prefix: str) -> int | None:
    m = _LAYER.search("." + prefix + ".")
    return int(m.group(1)) if m else None


def layer_of(name: str) -> int | None:
    """Block index in an item name (``model.layers.3.mlp.up_proj.out`` -> 3), else None."""
    return _layer_of_prefix(name.rpartition(".")[0])
