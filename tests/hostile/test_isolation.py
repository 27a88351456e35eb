"""Nothing touches the network; a handful of hostile runs in real subprocesses (issue 8)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def no_network(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError(f"network use: socket{args!r}")
    monkeypatch.setattr(socket, "socket", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)
    monkeypatch.setattr(socket, "getaddrinfo", refuse)
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")  # offline mode would hide a download attempt


@pytest.mark.parametrize("argv", [
    ["estimate", "--model", "llama-3-8b", "--json"],
    ["estimate", "--model", "mixtral-8x7b", "--tp", "2", "--ep", "4", "--dp", "8", "--zero", "1"],
    ["trace", "--model", "gpt2", "--seq", "64", "--json"],
    ["compare", "--model", "gpt2", "--seq", "64"],
    ["plan", "--model", "llama-2-7b", "--gpus", "8", "--global-batch", "16", "--gpu", "h100-80gb"],
    ["estimate", "--model", "meta-llama/Llama-2-7b-hf"],  # a hub id is refused, never fetched
])
def test_commands_never_touch_the_network(cli, no_network, argv):
    r = cli(argv, timeout=120)
    assert r.rc in (0, 2), r.err
    assert "network use" not in r.err


def _run(args, tmp_path, timeout=120):
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    return subprocess.run([sys.executable, "-m", "trainmem.cli", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=tmp_path, env=env)


@pytest.mark.parametrize("args", [
    ["estimate", "--seq", "-5"],
    ["estimate", "--tp", "3"],
    ["estimate", "--model", "no-such-preset"],
    ["estimate", "--config", "/dev/zero"],
    # a fresh interpreter importing torch: ~5 s on CI's two cores, in the slow set
    pytest.param(["trace", "--model", "gpt2", "--seq", "1000000000000", "--snapshot", "s.pickle"],
                 marks=pytest.mark.slow),
])
def test_subprocess_one_line_exit_2_nothing_written(tmp_path, args):
    p = _run(args, tmp_path)
    assert p.returncode == 2, p.stderr
    assert "Traceback" not in p.stderr and len(p.stderr.strip().splitlines()) == 1, p.stderr
    assert p.stdout == ""
    assert list(tmp_path.iterdir()) == []
