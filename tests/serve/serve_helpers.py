"""A running ``trainmem serve`` in a thread, plain HTTP calls to it, and the CLI's JSON for the
same settings. (Not a conftest: a conftest module name can collide across test folders.)"""

from __future__ import annotations

import contextlib
import http.client
import json
import shlex
import threading
from typing import Iterator

from trainmem.cli import main
from trainmem.serve import make_server


@contextlib.contextmanager
def running_server(**kwargs) -> Iterator[str]:
    """``http://127.0.0.1:PORT`` of a server on a free loopback port, stopped on exit."""
    server = make_server(port=0, **kwargs)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        host, port = server.server_address[:2]
        yield f"http://{host}:{port}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(10)


def call(base: str, method: str, path: str, body: bytes | None = None,
         headers: dict | None = None) -> tuple[int, dict, bytes]:
    """(status, headers, body) of one request."""
    host_port = base.split("//", 1)[1]
    conn = http.client.HTTPConnection(host_port, timeout=60)
    try:
        conn.request(method, path, body=body, headers=headers or {})
        r = conn.getresponse()
        return r.status, {k.lower(): v for k, v in r.getheaders()}, r.read()
    finally:
        conn.close()


def post(base: str, path: str, obj: object) -> tuple[int, dict]:
    status, _, raw = call(base, "POST", path, json.dumps(obj).encode(), {"Content-Type": "application/json"})
    return status, json.loads(raw)


def cli_json(capsys, argv: list[str] | str) -> dict:
    """``trainmem ARGV`` run in-process; its stdout parsed as JSON."""
    if isinstance(argv, str):
        argv = shlex.split(argv)[1:]  # "trainmem estimate ..." as the page shows it
    capsys.readouterr()
    rc = main(argv)
    out, err = capsys.readouterr()
    assert rc == 0, err
    return json.loads(out)
