"""``outbox-relay ui``: the operator console on its own port."""

from __future__ import annotations

import click

from relay.cli.options import database_options, echo


@click.command(short_help="Serve the operator console (a web page).")
@database_options
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on.")
@click.option("--port", default=8089, show_default=True, type=click.IntRange(0, 65535))
@click.option(
    "--token-file",
    type=click.Path(dir_okay=False),
    help="File holding the token (instead of OUTBOX_UI_TOKEN).",
)
@click.option("--read-only", is_flag=True, help="Show everything, refuse every action.")
def ui(
    database_url: str, schema: str, host: str, port: int, token_file: str | None, read_only: bool
) -> None:
    """Serve the operator console: destinations, rows, endpoints, blocked keys, and the
    actions of the operations commands. Every request needs the token (OUTBOX_UI_TOKEN)."""
    import uvicorn

    from relay.ui.app import build_console
    from relay.ui.security import TokenError, load_token

    try:
        token = load_token(token_file)
    except TokenError as exc:
        raise click.UsageError(str(exc)) from None
    app = build_console(database_url, token, schema=schema, read_only=read_only)
    mode = " (read-only)" if read_only else ""
    echo(f"console{mode} on http://{host}:{port}/ for schema {schema!r}", err=True)
    uvicorn.run(app, host=host, port=port, log_level="warning", server_header=False)
