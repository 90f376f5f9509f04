"""`endpoints rotate-secret` and `endpoints reencrypt`: an endpoint's new signing secret, and
every secret moved under the first key of OUTBOX_ENDPOINT_SECRET_KEY."""

from __future__ import annotations

from datetime import timedelta

import click

from relay.cli.endpoints.options import (
    ENDPOINT_ID,
    MAX_KEEP_PREVIOUS_HOURS,
    finite,
    secret_file_option,
)
from relay.cli.endpoints.output import warn_if_unencrypted
from relay.cli.options import database_options, json_option, with_db
from relay.cli.render import echo, echo_json
from relay.ops import endpoints as ops
from relay.ops.endpoints import REENCRYPT_BATCH


@click.command("rotate-secret", short_help="Give an endpoint a new secret; prints it.")
@database_options
@json_option
@click.argument("endpoint_id", metavar="ID", type=ENDPOINT_ID)
@click.option(
    "--keep-previous-hours",
    type=click.FloatRange(0, MAX_KEEP_PREVIOUS_HOURS),
    default=24.0,
    show_default=True,
    metavar="H",
    callback=finite,
    help="How long the previous secret still signs too, so the receiver can switch.",
)
@secret_file_option
def rotate_secret(
    database_url: str,
    schema: str,
    as_json: bool,
    endpoint_id: int,
    keep_previous_hours: float,
    secret_file: str | None,
) -> None:
    """Give an endpoint a new secret; prints it.

    The previous secret signs too for --keep-previous-hours, while the receiver switches."""
    keep = timedelta(hours=keep_previous_hours)
    rotated = with_db(
        database_url,
        lambda c: ops.rotate_secret(c, schema, endpoint_id, keep_previous=keep, secret=secret_file),
    )
    ep = warn_if_unencrypted(rotated).endpoint
    if as_json:
        echo_json(rotated.to_json())
        return
    if secret_file is None:
        echo(f"new secret of endpoint {ep.id}: {ep.secret}")
    else:
        echo(f"endpoint {ep.id} now signs with the secret of --secret-file")
    until = ep.previous_secret_until
    echo(
        f"the previous secret stays valid until {until:%Y-%m-%d %H:%M:%S %Z}"
        if until and keep
        else "the previous secret no longer signs"
    )


@click.command(short_help="Re-encrypt every secret under the first key.")
@database_options
@json_option
@click.option(
    "--batch-size",
    type=click.IntRange(1, 10_000),
    default=REENCRYPT_BATCH,
    show_default=True,
    metavar="N",
    help="Endpoints per transaction.",
)
def reencrypt(database_url: str, schema: str, as_json: bool, batch_size: int) -> None:
    """Re-encrypt every secret under the first key.

    With OUTBOX_ENDPOINT_SECRET_KEY=new,old, every endpoint's secret and previous secret are
    rewritten under the new key (those stored unencrypted are encrypted), a batch per
    transaction; previous secrets past their window are cleared. Running it again is safe.
    An endpoint whose secret opens with none of the keys is left as it is, and named."""
    done = with_db(database_url, lambda c: ops.reencrypt(c, schema, batch_size=batch_size))
    if as_json:
        echo_json(done.to_json())
    elif done.encrypted or done.rewritten or done.expired_cleared:
        echo(
            f"{done.endpoints} endpoint(s): {done.encrypted} unencrypted secret(s) "
            f"encrypted and {done.rewritten} moved from an older key to the first key of "
            f"OUTBOX_ENDPOINT_SECRET_KEY; {done.expired_cleared} expired previous "
            "secret(s) cleared"
        )
    else:
        echo(
            f"{done.endpoints} endpoint(s): nothing to change, every secret is under the "
            "first key of OUTBOX_ENDPOINT_SECRET_KEY"
            + (" (but those below)" if done.unreadable else "")
        )
    if done.unreadable:
        ids = ", ".join(map(str, done.unreadable))
        raise click.ClickException(
            f"the secrets of endpoint(s) {ids} open with none of the keys in "
            "OUTBOX_ENDPOINT_SECRET_KEY and were left as they are: add the key they were "
            "encrypted with (after the new one) and run `outbox-relay endpoints reencrypt` again"
        )
