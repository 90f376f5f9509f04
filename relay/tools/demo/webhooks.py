"""The demo's second use: a webhook destination, its requests signed the Standard Webhooks way,
one of them refused once so that the relay's retry shows."""

from __future__ import annotations

import base64
import os
from typing import Any

from relay.tools.demo.orders import Placed
from relay.tools.demo.receiver import Receiver

PATH = "/billing"
# How long the retry after the refused attempt waits. Short, so that the demo stays quick; a
# webhook destination's default waits 5 s, then 5 min, 30 min, … (docs/webhooks.md).
RETRY_AFTER_S = 1.0


def new_secret() -> str:
    """A signing secret in the Standard Webhooks format: ``whsec_`` and 32 random bytes."""
    return "whsec_" + base64.b64encode(os.urandom(32)).decode()


def destination(receiver: Receiver, secret: str) -> dict[str, Any]:
    return {
        "kind": "webhook",
        "url": receiver.expect(PATH, secret),
        "secrets": [secret],
        # The receiver is on loopback, which the SSRF guard refuses unless told.
        "allow_private_networks": True,
        "backoff": {"schedule": [RETRY_AFTER_S], "jitter": 0},
    }


def report(
    receiver: Receiver, placed: Placed, refused: str, attempts: int | None, id_prefix: str
) -> tuple[list[str], bool]:
    """What the webhook receiver got: every request verified, every event delivered once,
    and the refused one redelivered with the same ``webhook-id``; whether all of that holds."""
    arrivals = receiver.at(PATH)
    verified = [a for a in arrivals if a.payload is not None]
    delivered = sorted(a.webhook_id for a in arrivals if a.status == 204)
    tries = [a for a in arrivals if a.webhook_id == refused]
    retried = [a.status for a in tries] == [503, 204]
    ok = (
        len(verified) == len(arrivals)
        and delivered == sorted(f"{id_prefix}{i}" for i in placed.webhook)
        and retried
        and attempts == 2
    )
    lines = [
        f"webhook: {len(arrivals)} signed requests to {PATH}, {len(verified)} verified; "
        f"{len(delivered)}/{len(placed.webhook)} events delivered ({'OK' if ok else 'MISMATCH'})"
    ]
    if retried:
        lines.append(
            f"  webhook-id {refused}: answered 503 at its first attempt, redelivered "
            f"{tries[1].at - tries[0].at:.1f} s later with the same webhook-id "
            f"(attempts={attempts})"
        )
    else:
        # Said as it happened: the retry line above only for the retry it describes.
        answered = ", ".join(str(a.status) for a in tries) or "nothing"
        lines.append(
            f"  webhook-id {refused}: answered {answered} (attempts={attempts}), not 503 then 204"
        )
    return lines, ok
