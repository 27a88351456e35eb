"""The traced templates on disk: ``$TRAINMEM_CACHE`` or ``~/.cache/trainmem/traced/``, one JSON file
per key, written atomically. The key hashes everything that changes what is kept for backward:
the config, the versions of trainmem, torch and transformers, the template format, the precision,
the attention kernel, recompute, device, routing and the sequence regime. Batch, sequence length,
optimizer and parallel layout do not enter it: one template serves them all.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from functools import lru_cache
from pathlib import Path
from typing import Any, Callable, Mapping

__all__ = ["cache_dir", "cache_key", "cached"]

FORMAT = 16  # bump when a template's content or meaning changes


def cache_dir() -> Path:
    root = os.environ.get("TRAINMEM_CACHE")
    return Path(root).expanduser() / "traced" if root else Path.home() / ".cache" / "trainmem" / "traced"


@lru_cache(maxsize=None)
def _version(package: str, file: str) -> str:
    """A package's version read from its source file, without importing it (torch takes seconds)."""
    import importlib.util
    try:
        spec = importlib.util.find_spec(package)
        text = Path(spec.origin).with_name(file).read_text(encoding="utf-8")[:20000]
    except (ImportError, AttributeError, TypeError, OSError):
        return "missing"
    m = re.search(r"__version__\s*(?::\s*str\s*)?=\s*['\"]([^'\"]+)", text)
    return m.group(1) if m else "unknown"


@lru_cache(maxsize=None)
def _trainmem_version() -> str:
    from trainmem.schemas import trainmem_version
    return trainmem_version()


def cache_key(config: Mapping[str, Any], settings: Mapping[str, Any]) -> str:
    payload = {"format": FORMAT, "config": config, "settings": settings, "trainmem": _trainmem_version(),
               "torch": _version("torch", "version.py"), "transformers": _version("transformers", "__init__.py")}
    text = json.dumps(payload, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def cached(key: str, build: Callable[[], dict]) -> tuple[dict, bool]:
    """The JSON stored under ``key``, else ``build()``'s, stored. Returns (data, hit). An unreadable
    or foreign file is rebuilt; a cache folder that cannot be written is only not written."""
    path = cache_dir() / f"{key}.json"
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        if isinstance(data, dict) and data.get("key") == key:
            return data["template"], True
    except (OSError, ValueError, KeyError):
        pass
    template = build()
    try:
        from trainmem.atomic import write_text_atomic
        write_text_atomic(path, json.dumps({"key": key, "template": template}))
    except OSError:
        pass
    return template, False
