"""``outbox-relay endpoints``: the webhook endpoints registered at runtime for destinations of
kind ``endpoints`` (see :mod:`outbox.endpoints`). Each command parses its options, runs its
operation (relay/ops/endpoints.py: each change one transaction, ``reencrypt`` one per batch)
and prints the result as text or ``--json``; a signing secret is printed only by ``add``,
``rotate-secret`` and ``show --show-secret``.

The operations import SQLAlchemy and outbox.endpoints when they run, not when ``--help`` lists
the commands, so that the operations commands keep starting fast (tests/test_imports.py).
"""

from __future__ import annotations

import click

from relay.cli.endpoints.commands import add, delete, disable, enable, list_, show, update
from relay.cli.endpoints.portal import portal_key, portal_token
from relay.cli.endpoints.secrets import reencrypt, rotate_secret


@click.group(short_help="Manage webhook endpoints registered at runtime.")
def endpoints() -> None:
    """Webhook endpoints registered at runtime.

    The receivers of destinations of kind `endpoints`: add, list, show, update, disable,
    enable, rotate-secret, delete; reencrypt moves their secrets under a new key. Relays see
    each change at their next claim. portal-token prints a token that opens a tenant's
    portal; portal-key a new key for them."""


for _command in (
    add,
    list_,
    show,
    update,
    disable,
    enable,
    rotate_secret,
    delete,
    reencrypt,
    portal_token,
    portal_key,
):
    endpoints.add_command(_command)
