"""``trainmem serve``: argument parsing and the serving loop only."""

from __future__ import annotations

import argparse

__all__ = ["add_parser", "run"]

DEFAULT_PORT = 8765


def _port(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--port={text!r}: must be an integer") from None
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"--port={value}: must be from 0 to 65535 (0: any free port)")
    return value


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("serve", help="an interactive page on a local server: move the controls, see the memory")
    p.add_argument("--port", type=_port, default=DEFAULT_PORT, help=f"TCP port (default {DEFAULT_PORT}; 0: any free port)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1, this machine only)")
    p.add_argument("--allow-remote", action="store_true",
                   help="allow a --host other machines can reach (the page has no authentication)")
    p.set_defaults(func=run)


def run(args) -> int:
    from trainmem.serve.server import make_server

    server = make_server(args.host, args.port, allow_remote=args.allow_remote)
    host, port = server.server_address[:2]
    shown = f"[{host}]" if ":" in host else host
    print(f"trainmem serve: http://{shown}:{port}/  (Ctrl-C stops)", flush=True)
    try:
        server.serve_forever()
    finally:
        server.server_close()
    return 0
