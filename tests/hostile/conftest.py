"""Run the CLI in-process with a hard time limit, and a tiny config every command accepts."""

from __future__ import annotations

import json
import signal

import pytest

from hostile_helpers import TINY, Run
from trainmem.cli import main

class Hang(BaseException):
    """Raised by the alarm: a BaseException so the CLI's own ``except Exception`` cannot swallow it."""


@pytest.fixture(scope="session")
def tiny(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("cfg") / "tiny.json"
    path.write_text(json.dumps(TINY))
    return str(path)


@pytest.fixture
def cli(capsys):
    def run(argv: list[str], timeout: int = 30) -> Run:
        def on_alarm(*_):
            raise Hang(f"trainmem {' '.join(argv)} ran past {timeout} s")
        old = signal.signal(signal.SIGALRM, on_alarm)
        signal.alarm(timeout)
        try:
            try:
                rc = main([str(a) for a in argv])
            except SystemExit as exc:
                rc = exc.code
        finally:
            signal.alarm(0)
            signal.signal(signal.SIGALRM, old)
        out, err = capsys.readouterr()
        return Run(rc, out, err)
    return run
