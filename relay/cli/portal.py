"""``outbox-relay portal``: the tenant portal's API on its own port, under ``/portal``."""

from __future__ import annotations

import click

from relay.cli.catalog import catalog_option, served_catalog
from relay.cli.endpoints.portal import _read_key_file
from relay.cli.options import database_options
from relay.cli.render import echo

PREFIX = "/portal"


@click.command(short_help="Serve the tenant portal's API (for your customers).")
@database_options
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on.")
@click.option("--port", default=8090, show_default=True, type=click.IntRange(0, 65535))
@click.option(
    "--key-file",
    metavar="PATH",
    callback=_read_key_file,
    help="The portal key(s) in this file (else OUTBOX_PORTAL_KEY).",
)
@click.option(
    "--destination",
    "destinations",
    multiple=True,
    required=True,
    metavar="NAME",
    help="An endpoints destination tenants may add endpoints to (repeat; the first is the "
    "default).",
)
@click.option(
    "--max-endpoints",
    type=click.IntRange(1, 10_000),
    default=50,
    show_default=True,
    help="Endpoints a tenant may have.",
)
@click.option(
    "--embed-origin",
    "embed_origins",
    multiple=True,
    metavar="ORIGIN",
    help="A site whose pages may frame the portal's (https://app.example.com; repeat). "
    "Default: none may.",
)
@click.option(
    "--allow-private-networks",
    is_flag=True,
    help="Let tenants add endpoints on private or loopback networks (a test set-up only).",
)
@catalog_option
def portal(
    database_url: str,
    schema: str,
    host: str,
    port: int,
    key_file: str | None,
    destinations: tuple[str, ...],
    max_endpoints: int,
    embed_origins: tuple[str, ...],
    allow_private_networks: bool,
    spec: str | None,
) -> None:
    """Serve the tenant portal's API: each of your tenants (customers) manages its own
    endpoints, reads what was sent to them and replays it, with a token your application
    mints (`endpoints portal-token`, outbox.endpoints.portal_token). Its OpenAPI document is
    at /portal/api/openapi.json. With --catalog, tenants see the event types of your catalog
    on those destinations, and may subscribe to no other."""
    import uvicorn
    from starlette.applications import Starlette
    from starlette.routing import Mount

    from outbox.endpoints.portal_tokens import KEY_VARIABLE, PortalKeyMissing, PortalKeys
    from outbox.errors import OutboxError
    from relay.obs.logs import configure
    from relay.portal.app import build_portal
    from relay.portal.changes import Policy

    try:
        keys = PortalKeys.of(key_file)
    except PortalKeyMissing:
        raise click.UsageError(
            f"no portal key: give --key-file or set {KEY_VARIABLE} (make one with "
            "`outbox-relay endpoints portal-key`)"
        ) from None
    except OutboxError as exc:
        raise click.UsageError(str(exc)) from None
    configure()
    policy = Policy(destinations, max_endpoints, allow_private_networks)
    served = build_portal(database_url, keys, policy, schema=schema, catalog=served_catalog(spec))
    app = Starlette(routes=[Mount(PREFIX, app=served)])
    echo(f"tenant portal API on http://{host}:{port}{PREFIX}/api/ for schema {schema!r}", err=True)
    uvicorn.run(app, host=host, port=port, log_level="warning", server_header=False)
