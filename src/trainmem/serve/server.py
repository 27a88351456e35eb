"""The local server: one page and a small JSON API, on the standard library's threading HTTP server.

Why the standard library: an estimate takes milliseconds, so a thread per request is plenty, and
trainmem keeps no runtime dependency. Routes:

  GET  /              the page (package data ``page.html``: inline script and style, no CDN)
  GET  /api/options   presets, GPUs, every field's choices, default and help
  POST /api/estimate  JSON request (:mod:`trainmem.serve.request`) -> estimate, verdict, chart
  POST /api/fit       the same request -> largest micro-batch and sequence, the advisor's fixes

Every error is a JSON ``{"error": "one line"}``: 400 for a request trainmem refuses (the CLI's
own message), 404/405 for a wrong route, 411/413/415 for a body that is missing, too large or not
JSON, 500 for a bug (never a traceback). Bound to loopback, the server also refuses requests whose
``Host`` is not a loopback name, so a web page elsewhere cannot reach it by DNS rebinding.
"""

from __future__ import annotations

import errno
import ipaddress
import json
import socket
import sys
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib.resources import files
from typing import Callable

from trainmem.errors import HTTPStatusError, SpecError, TrainmemError
from trainmem.serve.request import RequestError

__all__ = ["make_server", "is_loopback", "MAX_BODY_BYTES"]

MAX_BODY_BYTES = 64 << 10  # a request is a few hundred bytes
_LOOPBACK_NAMES = ("localhost", "127.0.0.1", "[::1]", "::1")
_CSP = ("default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; "
        "connect-src 'self'; img-src data:")


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:  # a host name: it may resolve anywhere
        return False


def _one_line(text: str) -> str:
    return " ".join(str(text).split())


def _post_routes() -> dict[str, Callable]:
    from trainmem.serve.api import estimate_response, fit_response
    return {"/api/estimate": estimate_response, "/api/fit": fit_response}


class _Handler(BaseHTTPRequestHandler):
    server_version = "trainmem"
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args) -> None:  # quiet: the terminal shows the address only
        pass

    def _send(self, status: HTTPStatus, body: bytes, content_type: str, extra: dict | None = None) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Cache-Control", "no-store")
        self.send_header("X-Content-Type-Options", "nosniff")
        for k, v in (extra or {}).items():
            self.send_header(k, v)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _json(self, status: HTTPStatus, obj: dict) -> None:
        self._send(status, json.dumps(obj).encode(), "application/json")

    def _error(self, status: HTTPStatus, message: str) -> None:
        self._json(status, {"error": _one_line(message)})

    def _guarded(self, work: Callable[[], None]) -> None:
        try:
            self._check_host()
            work()
        except HTTPStatusError as exc:
            self.close_connection = True  # a body may be left unread
            self._error(exc.status, str(exc))
        except RequestError as exc:  # the option parser's line, as the CLI prints it after "error:"
            self._error(HTTPStatus.BAD_REQUEST, str(exc))
        except TrainmemError as exc:  # the CLI's own ``Type: message`` line
            self._error(HTTPStatus.BAD_REQUEST, f"{type(exc).__name__}: {exc}")
        except Exception as exc:  # a bug: one line to the client and to the terminal, no traceback
            line = _one_line(f"internal error: {type(exc).__name__}: {exc}")
            sys.stderr.write(f"trainmem serve: {self.command} {self.path}: {line}\n")
            self._error(HTTPStatus.INTERNAL_SERVER_ERROR, line)

    def _check_host(self) -> None:
        if not self.server.check_host:
            return
        header = self.headers.get("Host") or ""
        name = header.split("]", 1)[0] + "]" if header.startswith("[") else header.rsplit(":", 1)[0]
        if name not in _LOOPBACK_NAMES:
            raise HTTPStatusError(HTTPStatus.FORBIDDEN, f"Host {header!r} is not a loopback address")

    def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
        self._guarded(self._get)

    do_HEAD = do_GET

    def do_POST(self) -> None:  # noqa: N802
        self._guarded(self._post)

    def _get(self) -> None:
        path = self.path.split("?", 1)[0]
        if path in ("/", "/index.html"):
            page = files("trainmem.serve").joinpath("page.html").read_bytes()
            self._send(HTTPStatus.OK, page, "text/html; charset=utf-8", {"Content-Security-Policy": _CSP})
        elif path == "/api/options":
            from trainmem.serve.api import options
            self._json(HTTPStatus.OK, options())
        elif path in _post_routes():
            raise HTTPStatusError(HTTPStatus.METHOD_NOT_ALLOWED, f"{path} takes POST with a JSON object")
        else:
            raise HTTPStatusError(HTTPStatus.NOT_FOUND, f"no such page: {path}")

    def _post(self) -> None:
        from trainmem.serve.request import parse_request

        path = self.path.split("?", 1)[0]
        route = _post_routes().get(path)
        if route is None:
            raise HTTPStatusError(HTTPStatus.NOT_FOUND if path != "/" else HTTPStatus.METHOD_NOT_ALLOWED,
                             f"no such endpoint: POST {path}")
        body = self._body()
        self._json(HTTPStatus.OK, route(parse_request(body)))

    def _body(self) -> object:
        kind = (self.headers.get("Content-Type") or "").split(";", 1)[0].strip().lower()
        length = self.headers.get("Content-Length")
        if length is None:
            raise HTTPStatusError(HTTPStatus.LENGTH_REQUIRED, "Content-Length is required")
        n = int(length) if length.strip().isdigit() else -1
        if n < 0:
            raise HTTPStatusError(HTTPStatus.BAD_REQUEST, f"Content-Length={length!r}: must be a whole number of bytes")
        if n > MAX_BODY_BYTES:
            raise HTTPStatusError(HTTPStatus.REQUEST_ENTITY_TOO_LARGE,
                             f"body of {n} bytes: the limit is {MAX_BODY_BYTES} bytes")
        raw = self.rfile.read(n)
        if kind != "application/json":
            raise HTTPStatusError(HTTPStatus.UNSUPPORTED_MEDIA_TYPE, f"Content-Type {kind or 'missing'!r}: "
                                                                "send application/json")
        try:
            return json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, ValueError, RecursionError) as exc:
            raise HTTPStatusError(HTTPStatus.BAD_REQUEST, f"body is not JSON: {exc}") from None


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    check_host = True


class _Server6(_Server):
    address_family = socket.AF_INET6


def make_server(host: str = "127.0.0.1", port: int = 0, *, allow_remote: bool = False) -> ThreadingHTTPServer:
    """A bound server (``serve_forever()`` runs it; port 0 picks a free one). A host that is not a
    loopback address needs ``allow_remote``."""
    if not is_loopback(host) and not allow_remote:
        raise SpecError("host", host, "is not a loopback address: serving other machines needs --allow-remote")
    if not isinstance(port, int) or isinstance(port, bool) or not 0 <= port <= 65535:
        raise SpecError("port", port, "must be an integer from 0 to 65535")
    cls = _Server6 if ":" in host else _Server
    try:
        server = cls((host.strip("[]"), port), _Handler)
    except OSError as exc:  # in use, not permitted, no such address or name
        field, value = ("port", port) if exc.errno in (errno.EADDRINUSE, errno.EACCES) else ("host", host)
        raise SpecError(field, value, exc.strerror or str(exc)) from None
    server.check_host = not allow_remote
    return server
