"""Run the CLI in-process with a hard time limit, and a tiny config every command accepts."""

from __future__ import annotations

import json
import signal
from dataclasses import dataclass

import pytest

from trainmem.cli import main

TINY = dict(model_type="llama", hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=128, max_position_embeddings=256, bos_token_id=1, eos_token_id=2)


class Hang(BaseException):
    """Raised by the alarm: a BaseException so the CLI's own ``except Exception`` cannot swallow it."""


@dataclass
class Run:
    rc: int | str
    out: str
    err: str

    @property
    def lines(self) -> list[str]:
        return self.err.strip().splitlines()


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


def assert_one_line_error(r: Run) -> None:
    assert r.rc == 2, (r.rc, r.err[-500:])
    assert "Traceback" not in r.err and "internal error" not in r.err, r.err[-500:]
    assert len(r.lines) == 1, r.err[-1000:]
