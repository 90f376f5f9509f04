"""``outbox-relay ui``: the operator console on its own port."""

from __future__ import annotations

import os

import click

from relay.cli.catalog import catalog_option, served_catalog
from relay.cli.options import database_options, snapshot_warning_option
from relay.cli.render import echo
from relay.obs import scrub


@click.command(short_help="Serve the operator console (a web page).")
@database_options
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on.")
@click.option("--port", default=8089, show_default=True, type=click.IntRange(0, 65535))
@click.option(
    "--token-file",
    type=click.Path(dir_okay=False),
    help="File holding the token (instead of OUTBOX_UI_TOKEN).",
)
@click.option(
    "--operators-file",
    type=click.Path(dir_okay=False),
    envvar="OUTBOX_UI_OPERATORS_FILE",
    show_envvar=True,
    help='TOML file of name = "token" lines: a token per operator, each named in the log of '
    "their actions (or OUTBOX_UI_OPERATORS, a JSON object), instead of the shared token.",
)
@click.option("--read-only", is_flag=True, help="Show everything, refuse every action.")
@snapshot_warning_option
@catalog_option
def ui(
    database_url: str,
    schema: str,
    host: str,
    port: int,
    token_file: str | None,
    operators_file: str | None,
    read_only: bool,
    snapshot_warning: float,
    spec: str | None,
) -> None:
    """Serve the operator console: destinations, rows, endpoints, blocked keys, the event
    catalog (--catalog), and the actions of the operations commands. Every request needs the
    token (OUTBOX_UI_TOKEN), or an operator's own (OUTBOX_UI_OPERATORS)."""
    import uvicorn

    from relay.config.tokens import TOKEN_VARIABLE, TokenError, load_operators, load_token
    from relay.obs.logs import configure
    from relay.ui.app import build_console

    try:
        operators = load_operators(operators_file)
        if operators is not None and (token_file is not None or os.environ.get(TOKEN_VARIABLE)):
            raise TokenError(
                "both a shared token (--token-file or OUTBOX_UI_TOKEN) and operators are "
                "given: with operators, each signs in with their own token and the shared one "
                "would act without a name; remove the shared token"
            )
        token = load_token(token_file) if operators is None else None
    except TokenError as exc:
        raise click.UsageError(str(exc)) from None
    # Its log (sign-ins, every action and who did it) as the relay's: JSON unless a terminal,
    # and never a token in it.
    scrub.register([token] if token is not None else (operators or {}).values())
    configure()
    app = build_console(
        database_url,
        token,
        schema=schema,
        read_only=read_only,
        operators=operators,
        snapshot_warning=snapshot_warning,
        catalog=served_catalog(spec),
    )
    mode = " (read-only)" if read_only else ""
    echo(f"console{mode} on http://{host}:{port}/ for schema {schema!r}", err=True)
    uvicorn.run(app, host=host, port=port, log_level="warning", server_header=False)
