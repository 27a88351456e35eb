"""trainmem's commands do not show torchao's CPU-build warnings (trainmem/dependency_logs.py)."""

import json
import logging
import subprocess
import sys

import pytest

from tiny_models import LLAMA
from trainmem.dependency_logs import silence_dependency_noise


def test_the_noise_is_dropped_only_while_silenced(caplog):
    torchao, pytree = logging.getLogger("torchao"), logging.getLogger("torch.utils._pytree")
    so = "Failed to load /venv/torchao/_C_mxfp8.cpython-310-x86_64-linux-gnu.so: Could not load this library"
    enum = "<enum 'KernelPreference'> is an Enum subclass and is now natively supported by torch.compile"
    with caplog.at_level(logging.WARNING):
        loud_again = silence_dependency_noise()
        try:
            torchao.warning(so)
            pytree.warning(enum)
            torchao.warning("torchao: something else")
        finally:
            loud_again()
        torchao.warning(so)  # a library user's logging is left alone
    assert [r.getMessage() for r in caplog.records] == ["torchao: something else", so]


@pytest.mark.slow
def test_trace_on_a_tiny_config_writes_nothing_to_stderr(tmp_path):
    """Building the transformers model imports torchao (transformers/quantizers/auto.py), whose CPU
    build logs 'Failed to load ...so' and torch's register_constant deprecation: not shown."""
    path = tmp_path / "config.json"
    path.write_text(json.dumps(LLAMA))
    run = subprocess.run([sys.executable, "-m", "trainmem.cli", "trace", "--model", str(path), "--seq", "32",
                          "--batch", "1"], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0 and run.stdout
    assert run.stderr == ""
