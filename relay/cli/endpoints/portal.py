"""`endpoints portal-key` and `endpoints portal-token`: a new portal key, and a token (or a
link) that opens the tenant portal for one tenant (outbox/endpoints/portal_tokens.py). The key
comes from --key-file or OUTBOX_PORTAL_KEY, never from an argument: ps shows arguments to
every user of the machine."""

from __future__ import annotations

from datetime import UTC, datetime

import click

from relay.cli.options import Duration, json_option, schema_option
from relay.cli.render import echo, echo_json
from relay.obs import scrub

MAX_KEY_FILE = 4096


@click.command("portal-key", short_help="Print a new key for portal tokens.")
def portal_key() -> None:
    """Print a new key for portal tokens (opk_ and 32 random bytes).

    Set it in OUTBOX_PORTAL_KEY for the application that mints the tokens and for the portal.
    To rotate: OUTBOX_PORTAL_KEY=new,old (the first signs, every one verifies)."""
    from outbox.endpoints.portal_tokens import new_portal_key

    echo(new_portal_key())


def _read_key_file(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    if value is None:
        return None
    try:
        with open(value, encoding="utf-8") as f:
            text = f.read(MAX_KEY_FILE + 1)
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise click.BadParameter(f"cannot read {value}: {reason}", ctx, param) from None
    keys = text.strip()
    scrub.register([k.strip() for k in keys.split(",") if k.strip()])
    if not keys or len(text) > MAX_KEY_FILE:
        raise click.BadParameter(
            f"{value} must hold the portal key (opk_…; several comma-separated), "
            f"at most {MAX_KEY_FILE} bytes",
            ctx,
            param,
        )
    return keys


@click.command("portal-token", short_help="Print a token (or link) opening a tenant's portal.")
@click.argument("tenant")
@click.option(
    "--ttl",
    type=Duration(),
    default=3600.0,
    show_default="1h",
    metavar="DURATION",
    help="How long the token opens the portal (at most 7d).",
)
@click.option("--read-only", is_flag=True, help="The tenant may look, not change or replay.")
@click.option(
    "--url",
    "base_url",
    metavar="URL",
    help="Print the portal's link instead: this URL (where the portal is served) with the "
    "token in its fragment.",
)
@click.option(
    "--key-file",
    metavar="PATH",
    callback=_read_key_file,
    help="The portal key in this file (else OUTBOX_PORTAL_KEY).",
)
@schema_option
@json_option
def portal_token(
    tenant: str,
    ttl: float,
    read_only: bool,
    base_url: str | None,
    key_file: str | None,
    schema: str,
    as_json: bool,
) -> None:
    """Print a token that opens the tenant portal for TENANT.

    Signed with the first key of --key-file or OUTBOX_PORTAL_KEY. With --url, the portal's
    link (the token in its fragment, which no server log sees)."""
    from outbox.endpoints import portal_tokens as pt
    from outbox.errors import OutboxError

    now = datetime.now(UTC)
    try:
        keys = pt.PortalKeys.of(key_file)
        token = pt.portal_token(
            tenant=tenant, ttl=ttl, key=keys, read_only=read_only, schema=schema, now=now
        )
        access = pt.verify_portal_token(token, key=keys, schema=schema, now=now)
        link = pt.portal_link(base_url, token) if base_url is not None else None
    except pt.PortalKeyMissing:
        raise click.UsageError(
            f"no portal key: give --key-file or set {pt.KEY_VARIABLE} (make one with "
            "`outbox-relay endpoints portal-key`; the same value for the application and "
            "the portal)"
        ) from None
    except OutboxError as exc:
        raise click.UsageError(str(exc)) from None
    if as_json:
        echo_json(
            {
                "tenant": access.tenant,
                "token_id": access.token_id,
                "write": access.write,
                "expires": access.expires.isoformat(),
                "token": token,
                "url": link,
            }
        )
        return
    echo(link or token)
