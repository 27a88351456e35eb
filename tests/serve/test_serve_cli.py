"""``trainmem serve`` as a person runs it: it prints the address, serves the page, and Ctrl-C stops
it without a traceback; a non-loopback host needs --allow-remote."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from serve_helpers import call

CMD = [sys.executable, "-m", "trainmem.cli", "serve"]


def _sigint_default():
    """The child starts with Ctrl-C's default disposition, as from a terminal: an ignored SIGINT is
    inherited across exec, and Python then keeps it ignored (the server never stops; the suite saw it)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_prints_the_address_serves_and_stops_on_ctrl_c():
    proc = subprocess.Popen([*CMD, "--port", "0"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=_sigint_default)
    try:
        line = proc.stdout.readline()  # flushed before serving
        assert line.startswith("trainmem serve: http://127.0.0.1:"), line
        base = line.split()[2].rstrip("/")
        status, _, page = call(base, "GET", "/")
        assert status == 200 and b"<title>trainmem</title>" in page
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130 and err.strip() == "interrupted", err  # the CLI's Ctrl-C path
    assert "Traceback" not in err


@pytest.mark.parametrize("argv, field", [
    (["--host", "0.0.0.0"], "SpecError: host='0.0.0.0': is not a loopback address: serving other machines "
                            "needs --allow-remote"),
    (["--port", "70000"], "--port=70000: must be from 0 to 65535"),
    (["--port", "http"], "--port='http': must be an integer"),
    (["--host", "no-such-host.invalid", "--allow-remote", "--port", "0"], "SpecError: host='no-such-host.invalid'"),
])
def test_refusals_are_one_line(argv, field):
    r = subprocess.run([*CMD, *argv], capture_output=True, text=True, timeout=60,
                       env={**os.environ, "TRAINMEM_DEBUG": ""})
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert field in r.stderr and r.stdout == ""


def test_serve_flags_are_frozen():
    from trainmem.cli import build_parser

    sub = next(a for a in build_parser()._actions if a.__class__.__name__ == "_SubParsersAction")
    flags = sorted(o for a in sub.choices["serve"]._actions for o in a.option_strings if o.startswith("--"))
    assert flags == ["--allow-remote", "--help", "--host", "--port"]
