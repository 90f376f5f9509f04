"""`endpoints add`, `list`, `show`, `update`, `disable`, `enable` and `delete`: each parses
its options, runs its operation (relay/ops/endpoints.py) and prints the result."""

from __future__ import annotations

from typing import Any

import click

from relay.cli import terminal
from relay.cli.endpoints.catalog import warn_event_types
from relay.cli.endpoints.options import (
    ENDPOINT_ID,
    RATE_LIMIT,
    changes,
    register_secret,
    secret_file_option,
    url_check_options,
)
from relay.cli.endpoints.output import (
    audience,
    print_activity,
    print_endpoint,
    state,
    warn_if_unencrypted,
)
from relay.cli.options import database_options, json_option, with_db
from relay.cli.render import confirm, echo, echo_json, print_table
from relay.ops import endpoints as ops

ARGV_WARNING = (
    "outbox-relay: warning: --secret is visible to other users of this machine while the "
    "command runs (ps, /proc); pass it with --secret-file PATH, or --secret-file - to read it "
    "from standard input"
)


@click.command(short_help="Register an endpoint; prints its secret.")
@database_options
@json_option
@click.argument("destination")
@click.argument("url")
@click.option("--tenant", help="Only this tenant's events (default: every tenant's).")
@click.option(
    "--event-type",
    "event_types",
    multiple=True,
    metavar="TYPE",
    help="Only events of this type (repeatable; default: every type).",
)
@click.option("--rate-limit", type=RATE_LIMIT, metavar="N", help="At most N requests a second.")
@click.option("--description", default="", help="A note for people: whose receiver it is.")
@click.option(
    "--secret",
    metavar="whsec_…",
    callback=register_secret,
    help="Sign with this secret (Standard Webhooks format) instead of a generated one; "
    "visible to other users while the command runs: prefer --secret-file.",
)
@secret_file_option
@click.option(
    "--catalog",
    "catalog_spec",
    metavar="SPEC",
    help="The event catalog (module:attr or catalog.json) to check --event-type against: a "
    "type it does not declare is a warning, not a refusal.",
)
@url_check_options
def add(
    database_url: str,
    schema: str,
    as_json: bool,
    destination: str,
    url: str,
    tenant: str | None,
    event_types: tuple[str, ...],
    rate_limit: int | None,
    description: str,
    secret: str | None,
    secret_file: str | None,
    allow_private_networks: bool,
    no_dns_check: bool,
    catalog_spec: str | None,
) -> None:
    """Register an endpoint; prints its secret.

    URL becomes an endpoint of DESTINATION (a destination of kind `endpoints`); the signing
    secret printed is shown again only by `show --show-secret`."""
    if secret is not None and secret_file is not None:
        raise click.UsageError("--secret and --secret-file contradict each other: give one")
    if secret is not None:
        echo(ARGV_WARNING, err=True)
    secret = secret if secret is not None else secret_file
    warn_event_types(catalog_spec, destination, event_types)
    new = ops.Registration(
        destination=destination,
        url=url,
        tenant=tenant,
        event_types=event_types,
        rate_limit=rate_limit,
        description=description,
        secret=secret,
        allow_private_networks=allow_private_networks,
        check_dns=not no_dns_check,
    )
    added = with_db(database_url, lambda c: ops.add(c, schema, new))
    ep = warn_if_unencrypted(added).endpoint
    if as_json:
        echo_json(added.to_json())
        return
    tenant_shown, types = audience(ep)
    echo(
        f"added endpoint {ep.id} to {ep.destination}: {ep.url} (tenant {tenant_shown}, "
        f"event types {types})"
    )
    if secret is None:
        echo(f"secret: {ep.secret}")
        echo(
            "give it to the receiver now to verify signatures; it is not shown again unless "
            f"asked for: `outbox-relay endpoints show {ep.id} --show-secret`"
        )


@click.command("list", short_help="List the endpoints (never their secrets).")
@database_options
@json_option
@click.option("--destination", help="Only this destination's endpoints.")
@click.option("--tenant", help="Only endpoints of this tenant (not those taking every tenant).")
def list_(
    database_url: str,
    schema: str,
    as_json: bool,
    destination: str | None,
    tenant: str | None,
) -> None:
    """List the endpoints (never their secrets)."""
    listed = with_db(
        database_url,
        lambda c: ops.list_endpoints(c, schema, destination=destination, tenant=tenant),
    )
    if as_json:
        echo_json(listed.to_json())
        return
    if not listed.endpoints:
        echo(
            "no endpoints" + (" match" if destination or tenant else "") + " (add one with "
            "`outbox-relay endpoints add DESTINATION URL`)"
        )
        return
    rows = [("ID", "DESTINATION", "URL", "TENANT", "EVENT TYPES", "RATE LIMIT", "STATE")]
    for ep in listed.endpoints:
        rate = f"{ep.rate_limit}/s" if ep.rate_limit else "-"
        rows.append((str(ep.id), ep.destination, ep.url, *audience(ep), rate, state(ep)))
    print_table(rows)


@click.command(short_help="Show an endpoint, its deliveries, its attempts.")
@database_options
@json_option
@click.argument("endpoint_id", metavar="ID", type=ENDPOINT_ID)
@click.option("--show-secret", is_flag=True, help="Print its signing secret too.")
def show(
    database_url: str, schema: str, as_json: bool, endpoint_id: int, show_secret: bool
) -> None:
    """Show an endpoint, its deliveries and attempts.

    Endpoint ID's settings and health, its deliveries by status with the last outcome, and
    its latest attempts."""
    shown = with_db(
        database_url, lambda c: ops.show(c, schema, endpoint_id, show_secret=show_secret)
    )
    if as_json:
        echo_json(shown.to_json())
        return
    print_endpoint(shown.endpoint)
    echo()
    print_activity(shown)


@click.command(short_help="Change an endpoint's settings.")
@database_options
@json_option
@click.argument("endpoint_id", metavar="ID", type=ENDPOINT_ID)
@click.option("--url", help="Send to this URL from now on.")
@click.option("--tenant", help="Only this tenant's events.")
@click.option("--all-tenants", is_flag=True, help="Every tenant's events.")
@click.option(
    "--event-type",
    "event_types",
    multiple=True,
    metavar="TYPE",
    help="Only events of these types (repeatable; replaces the list).",
)
@click.option("--all-event-types", is_flag=True, help="Events of every type.")
@click.option("--rate-limit", type=RATE_LIMIT, metavar="N", help="At most N requests a second.")
@click.option("--no-rate-limit", is_flag=True, help="No rate limit.")
@click.option("--description", help="A note for people (empty to clear it).")
@click.option(
    "--catalog",
    "catalog_spec",
    metavar="SPEC",
    help="The event catalog (module:attr or catalog.json) to check --event-type against: a "
    "type it does not declare is a warning, not a refusal.",
)
@url_check_options
def update(
    database_url: str,
    schema: str,
    as_json: bool,
    endpoint_id: int,
    allow_private_networks: bool,
    no_dns_check: bool,
    catalog_spec: str | None,
    **options: Any,
) -> None:
    """Change an endpoint's settings.

    Only what is given changes in endpoint ID; the rest stays as it is."""
    warn_event_types(catalog_spec, None, tuple(options.get("event_types") or ()))
    changed = changes(**options)
    updated = with_db(
        database_url,
        lambda c: ops.update(
            c,
            schema,
            endpoint_id,
            changed,
            allow_private_networks=allow_private_networks,
            check_dns=not no_dns_check,
        ),
    )
    if as_json:
        echo_json(updated.to_json())
        return
    echo(f"updated endpoint {updated.endpoint.id} ({', '.join(changed)})")
    print_endpoint(updated.endpoint)


@click.command(short_help="Stop sending to an endpoint.")
@database_options
@json_option
@click.argument("endpoint_id", metavar="ID", type=ENDPOINT_ID)
@click.option("--reason", help="Why; shown by `endpoints list` and `endpoints show`.")
def disable(
    database_url: str, schema: str, as_json: bool, endpoint_id: int, reason: str | None
) -> None:
    """Stop sending to an endpoint.

    Endpoint ID gets no requests until it is enabled again."""
    done = with_db(database_url, lambda c: ops.disable(c, schema, endpoint_id, reason=reason))
    if as_json:
        echo_json(done.to_json())
        return
    ep = done.endpoint
    echo(
        f"disabled endpoint {ep.id} ({ep.url}). Undo with `outbox-relay endpoints enable {ep.id}`."
    )


@click.command(short_help="Send to a disabled endpoint again.")
@database_options
@json_option
@click.argument("endpoint_id", metavar="ID", type=ENDPOINT_ID)
def enable(database_url: str, schema: str, as_json: bool, endpoint_id: int) -> None:
    """Send to a disabled endpoint again.

    Endpoint ID's health starts afresh: failures before it was disabled do not count."""
    done = with_db(database_url, lambda c: ops.enable(c, schema, endpoint_id))
    if as_json:
        echo_json(done.to_json())
        return
    echo(f"enabled endpoint {done.endpoint.id} ({done.endpoint.url})")


def _confirm_delete(database_url: str, schema: str, endpoint_id: int) -> None:
    if not terminal.stdin():
        raise click.UsageError(
            f"deleting endpoint {endpoint_id} cancels its unfinished deliveries and there is "
            "no terminal to confirm on: pass --yes to delete it"
        )
    # A transaction of its own: none stays open while someone reads the question.
    shown = with_db(database_url, lambda c: ops.show(c, schema, endpoint_id))
    ep = shown.endpoint
    confirm(
        f"delete endpoint {ep.id} of {ep.destination} ({ep.url}) and cancel its "
        f"{shown.deliveries.unfinished} unfinished deliveries?"
    )


@click.command(short_help="Delete an endpoint, cancelling its deliveries.")
@database_options
@json_option
@click.argument("endpoint_id", metavar="ID", type=ENDPOINT_ID)
@click.option("--yes", is_flag=True, help="Do not ask for confirmation.")
def delete(database_url: str, schema: str, as_json: bool, endpoint_id: int, yes: bool) -> None:
    """Delete an endpoint, cancelling its deliveries.

    Endpoint ID's unfinished deliveries end as cancelled (never sent). Asks first, unless
    --yes."""
    if not yes:
        _confirm_delete(database_url, schema, endpoint_id)
    deleted = with_db(database_url, lambda c: ops.delete(c, schema, endpoint_id))
    if as_json:
        echo_json(deleted.to_json())
        return
    echo(f"deleted endpoint {endpoint_id}; cancelled {deleted.cancelled} unfinished deliveries")
