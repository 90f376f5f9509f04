"""The demo's third use: endpoints registered at runtime, one per tenant, through the operation
``outbox-relay endpoints add`` runs (relay/ops/endpoints.py); each event fanned out to its
tenant's endpoint, signed with that endpoint's own secret."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import asyncpg

from outbox.dburl import to_asyncpg_dsn
from relay.ops import endpoints as ops
from relay.ops.common import AdminError
from relay.tools.demo.errors import DemoError
from relay.tools.demo.orders import ENDPOINTS, EVENT_TYPE, TENANTS, Placed
from relay.tools.demo.receiver import Receiver


@dataclass(frozen=True)
class Registered:
    id: int
    tenant: str
    path: str


def destination() -> dict[str, Any]:
    # The endpoints are on loopback: registered, and sent to, with private networks allowed.
    return {"kind": "endpoints", "allow_private_networks": True}


async def register(db_url: str, schema: str, receiver: Receiver) -> list[Registered]:
    """An endpoint per tenant, at a path of the receiver of its own, taking its tenant's
    events of type ``order.created`` only."""
    conn = await asyncpg.connect(to_asyncpg_dsn(db_url))
    found = []
    try:
        for tenant in TENANTS:
            path = f"/customers/{tenant}"
            new = ops.Registration(
                destination=ENDPOINTS,
                url=receiver.url + path,
                tenant=tenant,
                event_types=(EVENT_TYPE,),
                description=f"{tenant}'s receiver (outbox-relay demo)",
                allow_private_networks=True,
            )
            ep = (await ops.add(conn, schema, new)).endpoint
            assert ep.secret is not None  # generated, and returned by add alone
            receiver.expect(path, ep.secret)
            found.append(Registered(ep.id, tenant, path))
    except AdminError as exc:
        raise DemoError(f"registering the demo's endpoints: {exc}") from exc
    finally:
        await conn.close()
    return found


def report(
    receiver: Receiver, registered: list[Registered], placed: Placed, id_prefix: str
) -> tuple[list[str], bool]:
    """What each endpoint received: its tenant's events, each once and verified with its own
    secret, and nothing of the other's."""
    total = sum(map(len, placed.endpoints.values()))
    lines = []
    ok = True
    for ep in registered:
        arrivals = receiver.at(ep.path)
        got = sorted(a.webhook_id for a in arrivals if a.status == 204)
        expected = sorted(f"{id_prefix}{i}" for i in placed.endpoints[ep.tenant])
        fine = got == expected and all(a.payload is not None for a in arrivals)
        ok = ok and fine
        orders = sorted(a.payload["order_id"] for a in arrivals if a.status == 204)
        lines.append(
            f"  endpoint {ep.id} (tenant {ep.tenant}) at {ep.path}: "
            f"{len(got)} event{'' if len(got) == 1 else 's'}"
            + (f", orders {_some(orders)}" if orders else "")
            + ("" if fine else f" (MISMATCH: {len(expected)} expected)")
        )
    head = (
        f"endpoints: {total} event{'' if total == 1 else 's'} fanned out to "
        f"{len(registered)} endpoints, each request verified with its endpoint's own secret "
        f"({'OK' if ok else 'MISMATCH'})"
    )
    return [head, *lines], ok


def _some(numbers: list[int], shown: int = 6) -> str:
    text = ", ".join(map(str, numbers[:shown]))
    return text + (", …" if len(numbers) > shown else "")
