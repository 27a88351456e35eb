"""Item names follow module paths (``model.layers.3.mlp.up_proj.out``); what can be read from one.

Shared by the estimator, the planner and the renderers, so that none of them imports another
to parse a name. Which module paths are blocks, embeddings or the head is the family registry's
knowledge (``trainmem/families/``): every family's and profile's names, so these work on any item.
"""

from __future__ import annotations

import re
from functools import lru_cache

from trainmem.families import embedding_modules, head_modules, layer_containers, token_embedding_modules

__all__ = ["layer_of", "layer_index", "stack_block", "split_block", "as_block", "under", "is_head", "is_embedding",
           "is_token_embedding", "EMBEDDING_INDICES", "EMBEDDING_OUTPUT", "embedding_indices", "embedding_output",
           "is_embedding_indices"]


@lru_cache(maxsize=8)
def _patterns(containers: tuple[str, ...]) -> tuple[re.Pattern, re.Pattern]:
    """(".layers.3." anywhere in a dot-wrapped path, a block index to replace) for these containers."""
    alt = "|".join(sorted(map(re.escape, containers), key=len, reverse=True))
    return re.compile(rf"\.(?:{alt})\.(\d+)\."), re.compile(rf"\.({alt})\.\d+(?=\.|$)")


@lru_cache(maxsize=1 << 16)
def _layer_index(containers: tuple[str, ...], path: str) -> int | None:
    m = _patterns(containers)[0].search("." + path + ".")
    return int(m.group(1)) if m else None


def layer_index(path: str) -> int | None:
    """Block index in a module path or name (``model.layers.3`` or ``model.layers.3.mlp`` -> 3), else None."""
    return _layer_index(layer_containers(), path)


def layer_of(name: str) -> int | None:
    """Block index of an item's module (``model.layers.3.mlp.up_proj.out`` -> 3), else None."""
    return layer_index(name.rpartition(".")[0])


def stack_block(name: str, stacks: tuple[tuple[str, int], ...]) -> int | None:
    """Block of an item counted through ``stacks`` in their order, each ``(blocks' prefix, depth)``:
    an encoder-decoder's encoder blocks 0..n-1, then its decoder's n.. (``decoder.block.1.x`` -> n + 1),
    read from each stack's own block list (T5's blocks hold a ``layer`` list of their own); None
    outside them."""
    offset = 0
    for prefix, depth in stacks:
        if name.startswith(prefix):
            idx, _, rest = name[len(prefix):].partition(".")
            return offset + int(idx) if idx.isdigit() and rest else None
        offset += depth
    return None


def split_block(name: str) -> tuple[str, int, str] | None:
    """``model.layers.3.mlp.out`` -> (``model.layers.``, 3, ``mlp.out``): the blocks' prefix, the
    index and the path inside the block; None outside blocks."""
    m = _patterns(layer_containers())[0].search("." + name)  # positions in name are one less
    if not m:
        return None
    return name[:m.start(1) - 1], int(m.group(1)), name[m.end(1):]


def as_block(name: str, index: int = 0) -> str:
    """The same name in block ``index`` (every block index replaced)."""
    return _patterns(layer_containers())[1].sub(rf".\1.{index}", "." + name)[1:]


def under(name: str, modules: tuple[str, ...]) -> bool:
    """``name`` is one of ``modules`` or lies inside one."""
    return any(name == m or name.startswith(m + ".") for m in modules)


def is_head(name: str) -> bool:
    """After the last block: a final norm, the output layer or the loss (in any family or profile)."""
    return under(name, head_modules())


def is_embedding(name: str) -> bool:
    """An input embedding (token, position, token-type) or one of its states."""
    return under(name, embedding_modules())


def is_token_embedding(name: str) -> bool:
    """The token embedding (``get_input_embeddings()``) or one of its states."""
    return under(name, token_embedding_modules())


#: what an embedding keeps, named under its module (``model.embed_tokens.indices``, ``.out``) by every
#: profile: the hf rules (``estimate/rules_hf_parts.py`` ``_embedding``) and the traced one (``traced/record.py``)
EMBEDDING_INDICES = "indices"
EMBEDDING_OUTPUT = "out"


def embedding_indices(module: str) -> str:
    """The ids an embedding keeps for its weight's gradient (``model.embed_tokens.indices``)."""
    return f"{module}.{EMBEDDING_INDICES}"


def embedding_output(module: str) -> str:
    """An embedding module's output (``model.embed_tokens.out``)."""
    return f"{module}.{EMBEDDING_OUTPUT}"


def is_embedding_indices(name: str) -> bool:
    """An embedding's kept ids (:func:`embedding_indices`), by name alone: also for a module the
    family registry does not know (``--profile traced`` of an unmapped model)."""
    return name.rpartition(".")[2] == EMBEDDING_INDICES
