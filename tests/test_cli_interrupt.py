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


def _interrupted():
    raise KeyboardInterrupt


def test_in_process_main_gives_back_the_callers_sigint_handler(monkeypatch, capsys):
    import signal

    import trainmem.cli as cli
    monkeypatch.setattr(cli, "build_parser", _interrupted)
    before = signal.getsignal(signal.SIGINT)
    assert cli.main(["estimate"]) == 130
    assert signal.getsignal(signal.SIGINT) is before  # it was left SIG_IGN: a suite calling main() lost Ctrl-C
    assert capsys.readouterr().err == "interrupted\n"


def test_the_trainmem_command_keeps_sigint_ignored_while_it_exits(monkeypatch, capsys):
    import signal

    import trainmem.cli as cli
    monkeypatch.setattr(cli, "build_parser", _interrupted)
    monkeypatch.setattr(sys, "argv", ["trainmem", "estimate"])
    before = signal.getsignal(signal.SIGINT)
    try:
        assert cli.console() == 130
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGINT, before)
    assert capsys.readouterr().err == "interrupted\n"
