"""trainmem's own TOML config: one table per spec, keys are the spec field names.

::

    [model]
    name = "llama-3-8b"    # a preset, a config.json or a model folder (what --model takes)
    num_layers = 16        # any ModelSpec field overrides the named model

    [step]
    batch = 2
    seq = 8192
    precision = "mixed-bf16"

    [impl]
    attention = "flash"
    recompute = "selective"

    [parallel]
    tp = 2
    sp = true

Unknown tables and keys are errors that name the key; values are type-checked here and
validated by the specs when they are built.
"""

from __future__ import annotations

from pathlib import Path

from trainmem.errors import ConfigError
from trainmem.inputs._common import SECTIONS, answer, check_type, field_types, load_toml, unknown_key

__all__ = ["read_config"]


def read_config(path: str | Path) -> dict:
    """Overrides from a trainmem TOML file (see the module docstring)."""
    data = load_toml(path, "trainmem config")
    overrides: dict[str, dict] = {}
    for section, body in data.items():
        if section not in SECTIONS:
            raise unknown_key(f"{path}", section, SECTIONS)
        if not isinstance(body, dict):
            raise ConfigError(f"{path}: {section} must be a table ([{section}]), got {body!r:.40}")
        types = field_types(section)
        out = overrides.setdefault(section, {})
        for key, value in body.items():
            if key not in types:
                raise unknown_key(f"{path}: [{section}]", key, types)
            out[key] = check_type(f"{path}: [{section}]", key, value, types[key])
    return answer("config", str(path), data, overrides, [])
