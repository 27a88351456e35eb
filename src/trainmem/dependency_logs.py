"""Log lines from dependencies that trainmem's commands do not show their users.

With torchao installed, building any transformers model imports torchao
(``transformers/quantizers/auto.py``), and a CPU build of torchao logs a warning for each
CUDA-only kernel library it cannot load (``torchao/__init__.py``: ``Failed to load ...so``) and
trips torch's deprecation warning for its ``register_constant`` on Enum classes
(``torch/utils/_pytree.py`` ``register_constant``). Neither concerns a memory estimate, and a
command's one-line error must stay one line. The CLI installs these filters for the duration of
one command; a library user's logging is left alone.
"""

from __future__ import annotations

import logging
from typing import Callable

__all__ = ["NOISE", "silence_dependency_noise"]

NOISE: dict[str, Callable[[str], bool]] = {
    "torchao": lambda msg: msg.startswith("Failed to load ") and ".so" in msg,
    "torch.utils._pytree": lambda msg: "is an Enum subclass and is now natively supported" in msg,
}
"""logger name -> whether one of its messages is the noise described above."""


class _Drop(logging.Filter):
    def __init__(self, is_noise: Callable[[str], bool]) -> None:
        super().__init__()
        self.is_noise = is_noise

    def filter(self, record: logging.LogRecord) -> bool:
        return not self.is_noise(record.getMessage())


def silence_dependency_noise() -> Callable[[], None]:
    """Drop :data:`NOISE` from its loggers; returns the function that puts them back as they were."""
    installed = [(logging.getLogger(name), _Drop(is_noise)) for name, is_noise in NOISE.items()]
    for log, f in installed:
        log.addFilter(f)

    def undo() -> None:
        for log, f in installed:
            log.removeFilter(f)
    return undo
