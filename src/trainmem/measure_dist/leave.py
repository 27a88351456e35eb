"""How a torchrun rank that has written its results ends: without Python's interpreter finalization.

gloo's worker threads (torch/csrc/distributed/c10d/ProcessGroupGloo.cpp, ``runLoop``) can still hold a finished
collective's work, and with it tensors that own Python objects, after ``destroy_process_group`` has returned (the
process group object lives on while a device mesh or a module still refers to it). A thread that drops such a tensor
while the interpreter finalizes must take the GIL from a dying interpreter; CPython 3.11 then ends that thread with
``pthread_exit``, the unwind crosses a ``noexcept`` C++ frame, and ``std::terminate`` aborts the rank ("terminate
called without an active exception", SIGABRT; the race pytorch/pytorch#179291 describes). It aborted one rank of an
FSDP2 CPU-offload test in one CI run of the slow suite. A rank whose results are on disk has nothing left to finalize:
flush and leave.
"""

from __future__ import annotations

import gc
import os
import sys
from typing import NoReturn


def leave(code: int) -> NoReturn:
    """Collect what is collectable while the interpreter is whole, flush stdout/stderr, and exit with ``code``
    without finalizing the interpreter (``os._exit``)."""
    gc.collect()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed or broken pipe: nothing more can be said on it
            pass
    os._exit(code)
