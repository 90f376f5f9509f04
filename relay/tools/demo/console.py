"""The console on the demo's kept database (`outbox-relay demo --keep`): served until Ctrl-C
(or SIGTERM), so that what the demo did can be looked at page by page: the three
destinations, the retried event with its two attempts, the endpoints and their message log.
The database stays afterwards; the demo says how to serve the console on it again."""

from __future__ import annotations

import asyncio
import contextlib
import socket

import click

from relay.tools.serving import served

HOST = "127.0.0.1"
# `outbox-relay ui`'s port, where it is free: the address the docs name.
PORT = 8089


def bind(host: str = HOST, port: int = PORT) -> socket.socket:
    """A listening socket on ``port`` or, taken, on a free one."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    # As uvicorn binds `outbox-relay ui`'s: the connections a console stopped a moment ago
    # closed (a minute of TIME_WAIT each) do not keep the next one from the port.
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError:
        sock.bind((host, 0))
    return sock


async def serve(db_url: str, schema: str, token: str, again: str, port: int = PORT) -> None:
    """Serve the console on ``db_url`` until the demo is interrupted, on ``port`` where it is
    free; ``again`` is the command that serves it later."""
    from relay.ui.app import build_console

    app = build_console(db_url, token, schema=schema)
    sock = bind(port=port)
    port = sock.getsockname()[1]
    if port != PORT:
        # `ui` would serve it on the port that was taken: the command names this one.
        again = f"{again} --port {port}"
    async with served(app, sock, "the console", lifespan="on", server_header=False) as task:
        click.echo(
            f"console: http://{HOST}:{port}/ (sign in with the token {token}); "
            "Ctrl-C stops it, the database stays"
        )
        # A stop asked for (Ctrl-C, SIGTERM) is the end of the demo, not a failure of it.
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.shield(task)
    click.echo(f"console stopped; serve it again with: {again}")
