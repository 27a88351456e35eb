"""Ctrl-C ends every command with one line and exit code 130, also under ``python -m`` when the
interrupt left a string exec (what dataclasses run while torch imports): see
cli._forget_unhandled_interrupt. Without the reset this run ends by SIGINT (-2)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

_MODULE = '''
import trainmem.cli as cli

def interrupted_in_a_string_exec():
    exec("raise KeyboardInterrupt", {})

cli.build_parser = interrupted_in_a_string_exec  # the first thing main() does
raise SystemExit(cli.main(["estimate"]))
'''


def test_ctrl_c_inside_a_string_exec_exits_130_under_dash_m(tmp_path):
    (tmp_path / "interrupt_during_exec.py").write_text(_MODULE)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT / "src")])}
    r = subprocess.run([sys.executable, "-m", "interrupt_during_exec"], capture_output=True, text=True, env=env,
                       timeout=60)
    assert (r.returncode, r.stderr) == (130, "interrupted\n")
