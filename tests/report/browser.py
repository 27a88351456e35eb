"""Headless Chromium for the HTML tests: the DOM after scripts ran, and a screenshot.
(Not a conftest: a conftest module name can collide across test folders.)"""

from __future__ import annotations

import os
import shutil
import struct
import subprocess
import zlib
from pathlib import Path

import pytest

FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
         "--disable-component-update", "--disable-sync", "--no-first-run", "--disable-dev-shm-usage"]


def chromium() -> str:
    path = os.environ.get("TRAINMEM_CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")
    if not path:
        pytest.skip("headless Chromium not installed (apt-get install chromium)")
    return path


def _run(args: list[str], tmp: Path) -> subprocess.CompletedProcess:
    cmd = [chromium(), *FLAGS, f"--user-data-dir={tmp / 'profile'}", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60)


def dump_dom(page: Path, tmp: Path) -> str:
    r = _run(["--dump-dom", page.resolve().as_uri()], tmp)
    assert r.returncode == 0, r.stderr[-2000:]
    return r.stdout


def screenshot(page: Path, out: Path, tmp: Path, size: str = "1200,1600") -> bytes:
    r = _run([f"--screenshot={out}", f"--window-size={size}", page.resolve().as_uri()], tmp)
    assert r.returncode == 0 and out.exists(), r.stderr[-2000:]
    return out.read_bytes()


def png_pixels(data: bytes) -> bytes:
    """The decompressed (still filtered) scanlines of a PNG: enough to tell blank from not."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    pos, idat = 8, b""
    while pos < len(data):
        (length,) = struct.unpack(">I", data[pos:pos + 4])
        kind = data[pos + 4:pos + 8]
        if kind == b"IDAT":
            idat += data[pos + 8:pos + 8 + length]
        pos += 12 + length
    return zlib.decompress(idat)
