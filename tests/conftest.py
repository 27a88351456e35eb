"""Fixtures shared by every test folder."""

from __future__ import annotations

import pytest


@pytest.fixture
def traced_cache(tmp_path_factory, monkeypatch):
    """``TRAINMEM_CACHE`` at one folder for the whole session: a ``--profile traced`` template is
    traced once and read back by every later test with the same key (estimate/traced/cache.py),
    never from the user's ``~/.cache``. Use with ``pytestmark = pytest.mark.usefixtures("traced_cache")``."""
    monkeypatch.setenv("TRAINMEM_CACHE", str(tmp_path_factory.getbasetemp() / "traced-cache"))
