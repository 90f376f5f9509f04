"""``outbox-relay init``: a commented starter relay.toml on stdout, and the next commands on
stderr (so that ``outbox-relay init > relay.toml`` writes only the file)."""

from __future__ import annotations

import base64
import secrets
import sys

import click

from relay.cli.render import echo_exact, echo_lines

# Each value a user must change is a URL (the bar: edited only in its URLs, the file
# passes `run --check`); everything else is a default worth seeing, commented.
TEMPLATE = """\
# relay.toml: the outbox relay's configuration (written by `outbox-relay init`).
# Every key can also come from the environment, which wins over this file:
# database_url -> OUTBOX_DATABASE_URL, [relay] batch_size -> OUTBOX_RELAY_BATCH_SIZE, ...
# Every key, its default and bounds: docs/configuration.md.

# The database that holds the outbox table. Better from the environment (a password is a
# secret): export OUTBOX_DATABASE_URL and delete this line.
database_url = "postgresql://outbox_relay@localhost:5432/app"

log_level = "info"        # debug | info | warning | error
log_format = "auto"       # json | console | auto (JSON unless stdout is a terminal)

[relay]
schema = "public"         # where `outbox-relay migrate` made the outbox table
batch_size = 500          # rows per claim
max_in_flight = 2000      # rows claimed and not yet recorded, at most
retention = "1h"          # how long delivered rows are kept (0: deleted as recorded)
max_attempts = 25         # then a row is failed (`outbox-relay retry` sends it again); of
                          # Kafka destinations: webhook and endpoints ones have their own, 10

[relay.backoff]           # delay before retry n: min(max, base * factor ** (n - 1)), +- jitter;
                          # of Kafka destinations (webhooks': the Standard Webhooks schedule)
base = 1.0
factor = 2.0
max = 600.0

[http]                    # /metrics, /health, /ready (and the console with [ui] enabled)
enabled = true
host = "127.0.0.1"
port = 9090

[kafka]
bootstrap_servers = ["localhost:9092"]
# security_protocol = "SASL_SSL"; sasl_mechanism = "SCRAM-SHA-512"; see docs/configuration.md

# Events enqueued with destination="orders" go to the Kafka topic "orders", keyed by their key.
[destinations.orders]
kind = "kafka"
topic = "orders"
# ordering = "key"        # per-key order across relays (docs/ordering.md)

# Events enqueued with destination="billing" are POSTed, signed (Standard Webhooks), to one URL.
[destinations.billing]
kind = "webhook"
url = "https://billing.example.com/webhooks/outbox"
# A signing secret made for you: give it to the receiver. Before production, move it to the
# environment: secret_env = "OUTBOX_BILLING_SECRET" instead of secrets.
secrets = ["{secret}"]
timeout = 10.0

# Events enqueued with destination="customer-hooks" go to the endpoints your customers register
# at run time (`outbox-relay endpoints add customer-hooks URL`, or outbox.endpoints), by tenant
# and event type (docs/endpoints.md).
[destinations.customer-hooks]
kind = "endpoints"

# [ui]                    # the operator console at /ui on the [http] listener (docs/console.md)
# enabled = true
"""

# Printed, not written: a file made by the shell's `>` is readable by every user under the usual
# umask, and this one holds a signing secret.
NEXT = """\
Next:
  1. chmod 600 relay.toml                           # it holds a webhook signing secret
  2. Edit the URLs in relay.toml (database_url, or export OUTBOX_DATABASE_URL; bootstrap_servers;
     the billing url), and drop the destinations you do not need.
  3. outbox-relay migrate --config relay.toml        # the outbox table, in your database
  4. Give the relay a role of its own (docs/deploying.md#the-database-roles).
  5. outbox-relay run --config relay.toml --check    # validates the file, changes nothing
  6. outbox-relay run --config relay.toml"""


def starter() -> str:
    """The starter relay.toml, with a webhook signing secret of its own."""
    secret = "whsec_" + base64.b64encode(secrets.token_bytes(32)).decode()
    return TEMPLATE.replace("{secret}", secret)


@click.command(short_help="Print a commented starter relay.toml.")
def init() -> None:
    """Print a commented starter relay.toml (Kafka, webhook and endpoints destinations, and the
    settings people change first) on stdout, and the next commands on stderr:

        outbox-relay init > relay.toml"""
    echo_exact(starter().removesuffix("\n"))
    if sys.stdout.isatty():  # shown, not kept: its secret is made anew by the next run
        echo_lines("To keep it: outbox-relay init > relay.toml", err=True)
    echo_lines(NEXT, err=True)
