"""measure_dist/leave.py: a torchrun rank that has written its results exits with its code, its output flushed,
and without the interpreter's finalization (where gloo's threads can abort it)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

_SCRIPT = textwrap.dedent("""
    import atexit, sys
    from trainmem.measure_dist.leave import leave
    atexit.register(lambda: print("finalized"))  # runs only if the interpreter finalizes
    sys.stdout.write("result written")  # no newline: only a flush brings it out
    sys.stderr.write("note")
    leave(int(sys.argv[1]))
""")


def test_leave_exits_with_the_code_flushed_and_unfinalized():
    for code in (0, 3):
        out = subprocess.run([sys.executable, "-c", _SCRIPT, str(code)], capture_output=True, text=True, timeout=60)
        assert (out.returncode, out.stdout, out.stderr) == (code, "result written", "note")
