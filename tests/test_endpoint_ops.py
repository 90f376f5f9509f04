"""The operations commands for endpoints destinations against a real database: `show` lists an
event's deliveries and attempts, `replay` sends events again, `status` lists the endpoints.
Rows are written with SQL, as the relay would have left them; no command may print a secret or
the path or query of an endpoint's URL."""

from __future__ import annotations

import asyncio
import json
import sys
from typing import Any

import asyncpg
import psycopg
import pytest
from click.testing import CliRunner, Result

import outbox
from outbox.dburl import to_asyncpg_dsn
from relay.cli import main, terminal
from relay.cli.options import EXIT_CONDITION
from relay.db.queries import render_ops
from relay.ops import admin, queries, replay_queries
from tests.support.receiver import Receiver
from tests.support.relays import running, settings, wait_until
from tests.webhook_helpers import verify

DEST = "customer-events"
# What must never be printed: the path and query of the URL, and the signing secrets.
PATH_TOKEN = "pathTok3nQx81"
QUERY_TOKEN = "queryTok3nZz42"
URL = f"https://hooks.acme.example:8443/in/{PATH_TOKEN}?key={QUERY_TOKEN}"
ORIGIN = "https://hooks.acme.example:8443"
SECRET = "whsec_c2VjcmV0TWFya2VyOTk5OTk5OTk5OTk5OTk5OTk5OTk="
PREVIOUS = "whsec_cHJldmlvdXNNYXJrZXI5OTk5OTk5OTk5OTk5OTk5OTk="
NEVER_PRINTED = (PATH_TOKEN, QUERY_TOKEN, SECRET, PREVIOUS, "c2VjcmV0TWFya2Vy")


def cli(db_url: str, *args: str, input: str | None = None) -> Result:
    res = CliRunner().invoke(main, [args[0], "--database-url", db_url, *args[1:]], input=input)
    for leak in NEVER_PRINTED:
        assert leak not in res.output, f"{leak!r} printed by {args}:\n{res.output}"
    return res


def cli_json(db_url: str, *args: str) -> Any:
    res = cli(db_url, *args, "--json")
    assert res.exit_code == 0, res.output
    return json.loads(res.output)


def sql(db_url: str, query: str, *params: Any) -> list[tuple[Any, ...]]:
    with psycopg.connect(db_url, autocommit=True) as c:
        cur = c.execute(query, params or None)
        return cur.fetchall() if cur.description else []


def endpoint(
    db_url: str,
    destination: str = DEST,
    url: str = URL,
    *,
    enabled: bool = True,
    reason: str | None = None,
    failing_ago: str | None = None,
    success_ago: str | None = None,
) -> int:
    [(eid,)] = sql(
        db_url,
        """
        INSERT INTO outbox_endpoints (destination, url, secret, previous_secret,
                                      previous_secret_until, enabled, disabled_reason,
                                      disabled_at, failing_since, last_success_at)
        VALUES (%s, %s, %s, %s, now() + interval '1 day', %s, %s,
                CASE WHEN NOT %s THEN now() END, now() - %s::interval, now() - %s::interval)
        RETURNING id
        """,
        destination,
        url,
        SECRET,
        PREVIOUS,
        enabled,
        reason,
        enabled,
        failing_ago,
        success_ago,
    )
    return int(eid)


def event(
    db_url: str,
    destination: str = DEST,
    status: str = "delivered",
    *,
    tenant: str | None = None,
    event_type: str | None = None,
) -> int:
    [(i,)] = sql(
        db_url,
        """
        INSERT INTO outbox (destination, payload, content_type, status, attempts, delivered_at,
                            tenant, event_type)
        VALUES (%s, '{"n":1}', 'application/json', %s, %s,
                CASE WHEN %s = 'delivered' THEN now() END, %s, %s)
        RETURNING id
        """,
        destination,
        status,
        1 if status == "delivered" else 0,
        status,
        tenant,
        event_type,
    )
    return int(i)


def delivery(
    db_url: str,
    event_id: int,
    endpoint_id: int,
    status: str = "delivered",
    *,
    attempts: int = 1,
    last_status: int | None = None,
    error: str | None = None,
    age: str = "1 min",
    run_in: str = "0s",
    locked_by: str | None = None,
    destination: str = DEST,
) -> int:
    [(i,)] = sql(
        db_url,
        """
        INSERT INTO outbox_deliveries (event_id, endpoint_id, destination, status, attempts,
                                       last_status, last_error, created_at, run_after,
                                       locked_by, locked_until, finished_at)
        VALUES (%s, %s, %s, %s, %s, %s, %s, now() - %s::interval, now() + %s::interval, %s,
                CASE WHEN %s::text IS NOT NULL THEN now() + interval '30 s' END,
                CASE WHEN %s IN ('delivered', 'failed', 'cancelled') THEN now() END)
        RETURNING id
        """,
        event_id,
        endpoint_id,
        destination,
        status,
        attempts,
        last_status,
        error,
        age,
        run_in,
        locked_by,
        locked_by,
        status,
    )
    return int(i)


def attempt(
    db_url: str,
    delivery_id: int,
    *,
    http_status: int | None,
    error: str | None = None,
    response: str | None = None,
    replay: bool = False,
    ago: str = "0s",
) -> None:
    sql(
        db_url,
        """
        INSERT INTO outbox_attempts (delivery_id, event_id, endpoint_id, at, http_status,
                                     duration_ms, response, error, replay)
        SELECT id, event_id, endpoint_id, now() - %s::interval, %s, 81.25, %s, %s, %s
        FROM outbox_deliveries WHERE id = %s
        """,
        ago,
        http_status,
        response,
        error,
        replay,
        delivery_id,
    )


def deliveries(db_url: str) -> dict[int, dict[str, Any]]:
    """Every delivery by id, with what a replay changes."""
    rows = sql(
        db_url,
        """
        SELECT id, event_id, endpoint_id, destination, status, attempts, replay,
               finished_at IS NULL, run_after <= now(), locked_by
        FROM outbox_deliveries
        """,
    )
    keys = (
        "event_id",
        "endpoint_id",
        "destination",
        "status",
        "attempts",
        "replay",
        "unfinished",
        "due",
        "locked_by",
    )
    return {r[0]: dict(zip(keys, r[1:], strict=True)) for r in rows}


def replayed(d: dict[str, Any]) -> bool:
    return (d["status"], d["attempts"], d["replay"], d["unfinished"], d["due"]) == (
        "pending",
        0,
        True,
        True,
        True,
    ) and d["locked_by"] is None


def notified(db_url: str, action: Any) -> list[str]:
    """The NOTIFYs on the outbox channel while ``action`` runs (their channels)."""
    with psycopg.connect(db_url, autocommit=True) as listener:
        listener.execute('LISTEN "public.outbox"')
        action()
        return [n.channel for n in listener.notifies(timeout=0.5)]


# --- show -----------------------------------------------------------------------------------


def test_show_lists_an_events_deliveries_and_its_attempts(db_url: str) -> None:
    ok, down = endpoint(db_url), endpoint(db_url, url="http://[::1]:9000/x/" + PATH_TOKEN)
    gone = 424242  # an endpoint deleted since
    e = event(db_url)
    d_ok = delivery(db_url, e, ok, last_status=200)
    d_down = delivery(
        db_url, e, down, "failed", attempts=3, last_status=503, error="HTTP 503 from there"
    )
    delivery(db_url, e, gone, "cancelled", attempts=0, error="endpoint 424242 was deleted")
    long_answer = "busy " * 40 + "END-OF-ANSWER"
    attempt(db_url, d_down, http_status=503, error="HTTP 503 from there", ago="3 min")
    attempt(db_url, d_down, http_status=None, error="connection refused", ago="2 min")
    attempt(db_url, d_ok, http_status=200, response=long_answer, ago="1 min")
    attempt(db_url, d_down, http_status=503, error="HTTP 503 again", replay=True)

    data = cli_json(db_url, "show", str(e))
    assert [r["id"] for r in data["rows"]] == [e] and data["missing"] == []
    # What needs a look first: failed, then the rest.
    assert [(d["endpoint_id"], d["status"]) for d in data["deliveries"]] == [
        (down, "failed"),
        (gone, "cancelled"),
        (ok, "delivered"),
    ]
    failed, cancelled, delivered = data["deliveries"]
    assert failed["origin"] == "http://[::1]:9000" and delivered["origin"] == ORIGIN
    assert cancelled["origin"] is None  # the endpoint is gone
    assert (failed["attempts"], failed["last_status"], failed["last_error"]) == (
        3,
        503,
        "HTTP 503 from there",
    )
    assert failed["finished_at"] and failed["event_id"] == e
    assert set(failed) >= {"id", "run_after", "locked_by", "created_at"}
    log = data["attempts"]
    assert [(a["endpoint_id"], a["http_status"], a["replay"]) for a in log] == [
        (down, 503, False),
        (down, None, False),
        (ok, 200, False),
        (down, 503, True),
    ]
    assert log[2]["response"] == long_answer  # whole in JSON
    assert log[1]["error"] == "connection refused" and log[0]["duration_ms"] == 81.2
    assert log[0]["delivery_id"] == d_down and log[0]["event_id"] == e

    text = cli(db_url, "show", str(e))
    assert text.exit_code == 0, text.output
    out = text.output
    assert "deliveries:      3 (1 cancelled, 1 delivered, 1 failed)" in out
    assert ORIGIN in out and "http://[::1]:9000" in out and "(deleted)" in out
    assert "attempt_log:     4 attempt(s), oldest first" in out
    replay_line = next(line for line in out.splitlines() if "HTTP 503 again" in line)
    assert "replay" in replay_line.split()
    assert "response: busy busy" in out and "END-OF-ANSWER" not in out  # cut in text
    assert "connection refused" in out


def test_show_of_other_events_is_unchanged(db_url: str) -> None:
    kafka = event(db_url, "orders", "pending")
    endpoint(db_url)  # endpoints exist, of another destination
    data = cli_json(db_url, "show", str(kafka))
    assert data["deliveries"] == [] and data["attempts"] == []
    assert [r["id"] for r in data["rows"]] == [kafka]
    text = cli(db_url, "show", str(kafka))
    assert text.exit_code == 0
    assert "deliveries" not in text.output and "attempt_log" not in text.output
    assert text.output.splitlines()[-1].startswith("payload_preview:")


def test_show_says_so_when_a_delivery_has_no_attempt_yet(db_url: str) -> None:
    e = event(db_url)
    delivery(db_url, e, endpoint(db_url), "pending", attempts=0)
    out = cli(db_url, "show", str(e)).output
    assert "deliveries:      1 (1 pending)" in out
    assert "attempt_log:     no attempts yet" in out


# --- replay ID ------------------------------------------------------------------------------


def test_replay_puts_every_delivery_of_the_event_back_as_a_replay(db_url: str) -> None:
    eps = [endpoint(db_url) for _ in range(5)]
    e = event(db_url)
    other_event = event(db_url)
    ids = {
        "delivered": delivery(db_url, e, eps[0], last_status=200),
        "failed": delivery(db_url, e, eps[1], "failed", attempts=25, error="gave up"),
        "cancelled": delivery(db_url, e, eps[2], "cancelled", attempts=0),
        "pending": delivery(db_url, e, eps[3], "pending", attempts=2, run_in="1 hour"),
        "running": delivery(db_url, e, eps[4], "running", attempts=1, locked_by="relay-a"),
        "deleted endpoint": delivery(db_url, e, 999_999, "failed"),
    }
    untouched = delivery(db_url, other_event, eps[0], "failed")
    before = deliveries(db_url)

    result: dict[str, Any] = {}
    channels = notified(db_url, lambda: result.update(cli_json(db_url, "replay", str(e))))
    assert channels == ["public.outbox"]  # the relays wake at once
    assert result["event_id"] == e and result["destination"] == DEST
    assert (result["replayed"], result["running"], result["endpoint_deleted"]) == (4, 1, 1)
    assert result["created"] == 0 and result["disabled_endpoints"] == []
    was = {d["endpoint_id"]: (d["was"], d["replayed"]) for d in result["deliveries"]}
    assert was == {
        eps[0]: ("delivered", True),
        eps[1]: ("failed", True),
        eps[2]: ("cancelled", True),
        eps[3]: ("pending", True),
        eps[4]: ("running", False),
        999_999: ("failed", False),
    }
    running = next(d for d in result["deliveries"] if d["endpoint_id"] == eps[4])
    assert running["held_by"] == "relay-a" and running["origin"] == ORIGIN

    after = deliveries(db_url)
    for name in ("delivered", "failed", "cancelled", "pending"):
        assert replayed(after[ids[name]]), (name, after[ids[name]])
    assert after[ids["running"]] == before[ids["running"]]  # left to its relay
    assert after[ids["deleted endpoint"]] == before[ids["deleted endpoint"]]
    assert after[untouched] == before[untouched]


def test_replay_in_text_says_what_it_did_and_left_alone(db_url: str) -> None:
    sent, busy = endpoint(db_url), endpoint(db_url)
    off = endpoint(db_url, enabled=False, reason="moved")
    e = event(db_url)
    delivery(db_url, e, sent, "failed")
    delivery(db_url, e, busy, "running", locked_by="relay-b")
    delivery(db_url, e, off, "delivered")
    res = cli(db_url, "replay", str(e))
    assert res.exit_code == 0, res.output
    out = res.output
    assert f"replaying event {e} to 2 endpoint(s) with the same webhook-id ({e})" in out
    assert f"endpoint {sent} ({ORIGIN}): was failed" in out
    assert f"endpoint {busy} ({ORIGIN}): left alone, running: relay relay-b" in out
    assert f"endpoint {off} is disabled: its replay waits until" in out
    assert f"outbox-relay endpoints enable {off}" in out

    only_running = event(db_url)
    delivery(db_url, only_running, busy, "running", locked_by="relay-b")
    quiet = cli(db_url, "replay", str(only_running))
    assert quiet.exit_code == 0 and f"nothing replayed for event {only_running}" in quiet.output


def test_replay_to_one_endpoint_and_to_one_the_event_never_went_to(db_url: str) -> None:
    first, second, added = endpoint(db_url), endpoint(db_url), endpoint(db_url)
    e = event(db_url)
    d1 = delivery(db_url, e, first, "delivered")
    d2 = delivery(db_url, e, second, "failed")
    before = deliveries(db_url)

    one = cli_json(db_url, "replay", str(e), "--endpoint", str(first))
    assert (one["replayed"], one["created"], one["endpoint_id"]) == (1, 0, first)
    after = deliveries(db_url)
    assert replayed(after[d1]) and after[d2] == before[d2]

    new = cli_json(db_url, "replay", str(e), "--endpoint", str(added))
    assert (new["replayed"], new["created"]) == (1, 1)
    assert new["deliveries"] == [
        {
            "endpoint_id": added,
            "origin": ORIGIN,
            "was": None,
            "replayed": True,
            "created": True,
            "held_by": None,
            "endpoint_deleted": False,
            "endpoint_enabled": True,
            "mismatch": None,
        }
    ]
    [(dest, status, replay)] = sql(
        db_url,
        "SELECT destination, status, replay FROM outbox_deliveries "
        "WHERE event_id = %s AND endpoint_id = %s",
        e,
        added,
    )
    assert (dest, status, replay) == (DEST, "pending", True)
    text = cli(db_url, "replay", str(e), "--endpoint", str(added))
    assert text.exit_code == 0 and "was pending" in text.output  # the same delivery again
    assert sql(db_url, "SELECT count(*) FROM outbox_deliveries WHERE event_id = %s", e) == [(3,)]


def test_replay_refusals_change_nothing(db_url: str) -> None:
    ep = endpoint(db_url)
    elsewhere = endpoint(db_url, "other-events")
    e = event(db_url)
    delivery(db_url, e, ep, "failed")
    purged = event(db_url)
    d_purged = delivery(db_url, purged, ep, "delivered")
    sql(db_url, "DELETE FROM outbox WHERE id = %s", purged)
    kafka = event(db_url, "orders")
    waiting = event(db_url, DEST, "pending")
    before = deliveries(db_url)

    def refused(*args: str) -> str:
        res = cli(db_url, "replay", *args)
        assert res.exit_code == 1, res.output
        assert "Traceback" not in res.output and len(res.output.strip().splitlines()) == 1
        return res.output

    assert "no outbox row with id 987654" in refused("987654")
    out = refused(str(purged))
    assert f"no outbox row with id {purged}" in out and "no payload to send" in out
    out = refused(str(e), "--endpoint", str(elsewhere))
    assert f"endpoint {elsewhere} is an endpoint of 'other-events'" in out
    assert f"event {e} an event of {DEST!r}" in out
    assert "no endpoint 555" in refused(str(e), "--endpoint", "555")
    out = refused(str(kafka))
    assert f"event {kafka} of 'orders' has no deliveries" in out and "--endpoint EID" in out
    assert f"event {waiting} is pending" in refused(str(waiting))
    assert deliveries(db_url) == before
    assert before[d_purged]["status"] == "delivered"


def test_replay_never_crosses_tenants(db_url: str) -> None:
    """A replay goes only where fan-out would send the event now: never to an endpoint of
    another tenant, nor of other event types, whether it adds a delivery or sends one again
    (an endpoint handed over to another customer since the fan-out)."""
    acme, globex, acme_paid = endpoint(db_url), endpoint(db_url), endpoint(db_url)
    sql(db_url, "UPDATE outbox_endpoints SET tenant = 'acme' WHERE id IN (%s, %s)", acme, acme_paid)
    sql(db_url, "UPDATE outbox_endpoints SET tenant = 'globex' WHERE id = %s", globex)
    paid = "UPDATE outbox_endpoints SET event_types = '{invoice.paid}' WHERE id = %s"
    sql(db_url, paid, acme_paid)
    e = event(db_url, tenant="acme", event_type="invoice.voided")
    untenanted = event(db_url)
    d = delivery(db_url, e, acme, "failed")
    before = deliveries(db_url)

    def refused(*args: str) -> str:
        res = cli(db_url, "replay", *args)
        assert res.exit_code == 1, res.output
        assert "Traceback" not in res.output and len(res.output.strip().splitlines()) == 1
        return res.output

    out = refused(str(e), "--endpoint", str(globex))
    assert f"endpoint {globex} does not take event {e}" in out
    assert "takes tenant 'globex' only and the event is of tenant 'acme'" in out
    out = refused(str(e), "--endpoint", str(acme_paid))
    assert "takes event types invoice.paid only and the event is of type 'invoice.voided'" in out
    out = refused(str(untenanted), "--endpoint", str(acme))
    assert "takes tenant 'acme' only and the event has no tenant" in out
    assert deliveries(db_url) == before  # nothing added, nothing replayed

    # The endpoint that got the event moves to another tenant: its delivery is left alone.
    sql(db_url, "UPDATE outbox_endpoints SET tenant = 'initech' WHERE id = %s", acme)
    result = cli_json(db_url, "replay", str(e))
    assert (result["replayed"], result["mismatched"]) == (0, 1)
    [only] = result["deliveries"]
    assert not only["replayed"] and "takes tenant 'initech' only" in only["mismatch"]
    text = cli(db_url, "replay", str(e))
    assert "left alone, it no longer takes this event" in text.output
    window = cli_json(db_url, "replay", "--endpoint", str(acme), "--since", "1d", "--yes")
    assert (window["replayed"], window["skipped_not_taken"]) == (0, 1)
    assert deliveries(db_url)[d] == before[d]


@pytest.mark.parametrize(
    ("args", "says"),
    [
        ((), "say what to replay"),
        (("5", "--since", "1h"), "not both"),
        (("--since", "1h"), "give --endpoint EID"),
        (("5", "--failed-only"), "--failed-only goes with"),
        (("--endpoint", "1", "--since", "soon"), "not a duration"),
        (("0",), "0 is not in the range"),
    ],
)
def test_replay_usage_errors(db_url: str, args: tuple[str, ...], says: str) -> None:
    res = cli(db_url, "replay", *args)
    assert res.exit_code == 2, res.output
    assert says in res.output


def test_replay_needs_migration_0007(db_url: str) -> None:
    e = event(db_url)
    delivery(db_url, e, endpoint(db_url), "failed")
    sql(db_url, "ALTER TABLE outbox_deliveries DROP COLUMN replay")
    res = cli(db_url, "replay", str(e))
    assert res.exit_code == 1 and "run `outbox-relay migrate`" in res.output


# --- replay --endpoint EID --since ----------------------------------------------------------


def endpoint_history(db_url: str) -> tuple[int, dict[str, int]]:
    """An endpoint with deliveries in every state, inside and outside a 6 hour window."""
    ep, other = endpoint(db_url), endpoint(db_url)
    ids = {}
    for name, status, age in [
        ("delivered", "delivered", "1 hour"),
        ("failed", "failed", "2 hours"),
        ("cancelled", "cancelled", "3 hours"),
        ("old failed", "failed", "7 hours"),
        ("pending", "pending", "1 hour"),
        ("running", "running", "1 hour"),
    ]:
        ids[name] = delivery(
            db_url,
            event(db_url),
            ep,
            status,
            age=age,
            locked_by="relay-a" if status == "running" else None,
        )
    gone = event(db_url)
    ids["event gone"] = delivery(db_url, gone, ep, "failed", age="1 hour")
    sql(db_url, "DELETE FROM outbox WHERE id = %s", gone)
    ids["other endpoint"] = delivery(db_url, event(db_url), other, "failed", age="1 hour")
    return ep, ids


def test_replay_since_asks_for_yes_off_a_terminal(db_url: str) -> None:
    ep, _ = endpoint_history(db_url)
    before = deliveries(db_url)
    res = cli(db_url, "replay", "--endpoint", str(ep), "--since", "6h")
    assert res.exit_code == 2 and "pass --yes" in res.output
    assert deliveries(db_url) == before


def test_replay_since_failed_only_then_every_ended_delivery(db_url: str) -> None:
    ep, ids = endpoint_history(db_url)
    before = deliveries(db_url)

    result: dict[str, Any] = {}
    args = ("replay", "--endpoint", str(ep), "--since", "6h", "--yes")
    channels = notified(db_url, lambda: result.update(cli_json(db_url, *args, "--failed-only")))
    assert channels == ["public.outbox"]
    assert result["replayed"] == 1 and result["by_status"] == {"failed": 1}
    assert result["skipped_event_gone"] == 1 and result["failed_only"] is True
    assert result["since_s"] == 21600 and result["origin"] == ORIGIN
    after = deliveries(db_url)
    assert replayed(after[ids["failed"]])
    unchanged = set(ids) - {"failed"}
    assert all(after[ids[n]] == before[ids[n]] for n in unchanged), unchanged

    text = cli(db_url, *args)
    assert text.exit_code == 0, text.output
    # The failed one replayed above is pending now, due: it is replayed again with the others.
    assert f"replaying 4 not running deliveries of endpoint {ep} ({ORIGIN})" in text.output
    assert "1 delivered, 0 failed, 1 cancelled, 2 pending" in text.output
    assert "skipped 1 whose event is gone" in text.output
    final = deliveries(db_url)
    for name in ("delivered", "failed", "cancelled", "pending"):
        assert replayed(final[ids[name]]), name
    for name in ("old failed", "running", "event gone", "other endpoint"):
        assert final[ids[name]] == before[ids[name]], name

    again = cli(db_url, *args)
    assert again.exit_code == 0, again.output
    assert "replaying 4 not running deliveries" in again.output  # the replays, pending now
    assert cli(db_url, "replay", "--endpoint", "555", "--since", "1h", "--yes").exit_code == 1


def test_replay_since_on_a_terminal_asks_first(
    db_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(terminal, "stdin", lambda: True)
    ep, ids = endpoint_history(db_url)
    before = deliveries(db_url)
    args = ("replay", "--endpoint", str(ep), "--since", "6h", "--failed-only")
    no = cli(db_url, *args, input="n\n")
    assert no.exit_code == 1 and "Aborted" in no.output
    assert f"send again 1 failed deliveries (1 failed) of endpoint {ep} ({ORIGIN})" in no.output
    assert deliveries(db_url) == before
    yes = cli(db_url, *args, input="y\n")
    assert yes.exit_code == 0, yes.output
    assert replayed(deliveries(db_url)[ids["failed"]])


def test_replay_since_of_a_disabled_endpoint_says_the_replays_wait(db_url: str) -> None:
    ep = endpoint(db_url, enabled=False, reason="receiver moved")
    delivery(db_url, event(db_url), ep, "failed")
    res = cli(db_url, "replay", "--endpoint", str(ep), "--since", "1d", "--yes")
    assert res.exit_code == 0, res.output
    assert "replaying 1 not running deliveries" in res.output
    assert f"endpoint {ep} is disabled: the replays wait" in res.output


async def test_a_running_relay_sends_the_replay_with_the_same_webhook_id(
    db_url: str, receiver: Receiver
) -> None:
    """The whole path: the relay delivers an event, `replay` puts it back, the relay sends it
    again with the same webhook-id, signed, and logs that attempt as a replay."""
    ep = endpoint(db_url, url=receiver.url + "/in/" + PATH_TOKEN)
    conn = await asyncpg.connect(to_asyncpg_dsn(db_url))
    try:
        async with conn.transaction():
            event_id = await outbox.enqueue(conn, destination=DEST, payload={"n": 1})
    finally:
        await conn.close()
    dest = {
        "kind": "endpoints",
        "allow_private_networks": True,
        "backoff": {"schedule": [0.3], "jitter": 0},
    }
    config = settings(
        db_url, "127.0.0.1:9", destinations={DEST: dest}, relay={"poll_interval": 5, "lease": 5}
    )
    async with running(config):
        await wait_until(lambda: len(receiver.requests) == 1, what="first delivery")
        recorded = "SELECT status FROM outbox_deliveries"
        await wait_until(lambda: sql(db_url, recorded) == [("delivered",)], what="recorded")
        # A subprocess: the command runs its own event loop.
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "relay.cli",
            "replay",
            str(event_id),
            "--database-url",
            db_url,
            stdout=asyncio.subprocess.PIPE,
        )
        out, _ = await proc.communicate()
        assert proc.returncode == 0, out
        assert f"replaying event {event_id} to 1 endpoint(s)".encode() in out
        assert PATH_TOKEN.encode() not in out
        # Woken by the NOTIFY: well within the poll interval.
        await wait_until(lambda: len(receiver.requests) == 2, timeout=4, what="the replay")
        await wait_until(
            lambda: len(sql(db_url, "SELECT 1 FROM outbox_attempts")) == 2, what="logged"
        )
    first, again = receiver.requests
    assert first.headers["webhook-id"] == again.headers["webhook-id"] == str(event_id)
    assert again.body == first.body
    verify(SECRET, again.body, again.headers)
    log = sql(db_url, "SELECT endpoint_id, http_status, replay FROM outbox_attempts ORDER BY id")
    assert log == [(ep, 200, False), (ep, 200, True)]
    [d] = deliveries(db_url).values()
    assert (d["status"], d["replay"], d["attempts"]) == ("delivered", False, 1)


@pytest.mark.parametrize("form", ["event", "endpoint"])
async def test_a_replay_keeps_its_events_from_deletion_until_it_commits(
    db_url: str, form: str
) -> None:
    """Retention and purge delete an event only while none of its deliveries is open: until a
    replay commits, its events stay locked against a delete that did not see it."""
    ep = endpoint(db_url)
    e = event(db_url)
    delivery(db_url, e, ep, "failed")
    statement, args = {
        "event": (replay_queries.REPLAY_EVENT_ROW, (e,)),
        "endpoint": (replay_queries.REPLAY_ENDPOINT, (ep, 3600.0, ["failed"])),
    }[form]
    conn = await asyncpg.connect(to_asyncpg_dsn(db_url))
    other = await asyncpg.connect(to_asyncpg_dsn(db_url))
    try:
        await other.execute("SET lock_timeout = '200ms'")
        async with conn.transaction():
            assert await conn.fetch(render_ops(statement, "public"), *args)
            with pytest.raises(asyncpg.LockNotAvailableError):
                await other.execute("DELETE FROM outbox WHERE id = $1", e)
            # The relay's own writes to the event (no key change) are not held up.
            await other.execute("UPDATE outbox SET last_error = 'x' WHERE id = $1", e)
    finally:
        await conn.close()
        await other.close()


# --- status ---------------------------------------------------------------------------------


def test_status_lists_the_endpoints_that_need_a_look_first(db_url: str) -> None:
    healthy = endpoint(db_url, success_ago="1 min")
    failing = endpoint(db_url, url="https://down.example/x/" + PATH_TOKEN, failing_ago="2 hours")
    off = endpoint(db_url, "other-events", enabled=False, reason="moved to v2")
    e = event(db_url)
    d = delivery(db_url, e, healthy, last_status=200)
    attempt(db_url, d, http_status=200, ago="1 min")
    for age in ("10 min", "2 min"):
        p = delivery(db_url, event(db_url), failing, "pending", attempts=2, age=age)
        attempt(db_url, p, http_status=503, error="HTTP 503", ago="30 s")
    p = delivery(db_url, event(db_url), failing, "pending", age="1 min")
    attempt(db_url, p, http_status=None, error="connection refused", ago="5 s")  # the latest

    data = cli_json(db_url, "status")
    assert data["endpoints_total"] == 3 and data["endpoints_needing_attention"] == 2
    assert [x["id"] for x in data["endpoints"]] == [failing, off, healthy]
    f, o, h = data["endpoints"]
    assert f["origin"] == "https://down.example" and f["destination"] == DEST
    assert f["pending"] == 3 and 590 < f["oldest_pending_age_s"] < 900
    assert f["failing_since"] and f["enabled"] is True
    assert f["last_http_status"] is None and f["last_attempt_at"]  # no answer, last time
    assert o["enabled"] is False and o["disabled_reason"] == "moved to v2"
    assert o["disabled_at"] and o["pending"] == 0 and o["oldest_pending_age_s"] is None
    assert o["last_attempt_at"] is None and o["last_http_status"] is None
    assert h["last_http_status"] == 200 and h["last_success_at"] and h["failing_since"] is None
    assert set(h) == {
        "id",
        "destination",
        "origin",
        "enabled",
        "disabled_reason",
        "disabled_at",
        "pending",
        "oldest_pending_age_s",
        "failing_since",
        "last_http_status",
        "last_attempt_at",
        "last_success_at",
        "circuit",
        "circuit_open_until",
    }
    assert h["circuit"] == "closed" and h["circuit_open_until"] is None

    text = cli(db_url, "status")
    assert text.exit_code == 0, text.output
    out = text.output
    assert "endpoints (3 registered; 2 with pending deliveries, failing or disabled):" in out
    lines = out.splitlines()
    header = next(i for i, line in enumerate(lines) if line.strip().startswith("ID "))
    rows = [line.split() for line in lines[header + 1 : header + 4]]
    assert [r[0] for r in rows] == [str(failing), str(off), str(healthy)]
    assert rows[0][2:4] == ["https://down.example", "3"] and rows[0][4].startswith("10m")
    assert rows[0][6:] == ["none", "-", "closed", "enabled"]  # last attempt: no HTTP answer
    assert rows[2][6] == "200"
    assert "DISABLED: moved to v2" in out and ORIGIN in out
    assert "not listed" not in out


def test_status_keeps_the_endpoint_list_bounded(db_url: str) -> None:
    sql(
        db_url,
        "INSERT INTO outbox_endpoints (destination, url, secret) "
        "SELECT %s, %s, %s FROM generate_series(1, 60)",
        DEST,
        URL,
        SECRET,
    )
    off = endpoint(db_url, enabled=False)
    data = cli_json(db_url, "status")
    assert data["endpoints_total"] == 61 and data["endpoints_needing_attention"] == 1
    assert len(data["endpoints"]) == 50 and data["endpoints"][0]["id"] == off
    out = cli(db_url, "status").output
    assert "… 11 more endpoint(s) not listed: enabled, not failing, nothing pending" in out


def test_status_without_endpoints_adds_nothing_to_the_text(db_url: str) -> None:
    event(db_url, "orders", "pending")
    data = cli_json(db_url, "status")
    assert data["endpoints"] == [] and data["endpoints_total"] == 0
    out = cli(db_url, "status").output
    assert "endpoints" not in out and "orders" in out


def test_status_counts_pending_deliveries_from_the_claims_lanes(db_url: str) -> None:
    """Pending deliveries are counted from the claim's two lanes (migration 0018), which
    together hold each one once (migration 0020 dropped the index of all of them): never
    from the table, nor from the index of an endpoint's whole history. Half of them fresh,
    half due again (claimed before), and the lowest id of either lane gives the age."""
    eps = [endpoint(db_url) for _ in range(3)]
    sql(
        db_url,
        """
        INSERT INTO outbox_deliveries (event_id, endpoint_id, destination, status, finished_at,
                                       claims, created_at, run_after)
        SELECT g, %s, %s, CASE WHEN g %% 100 = 0 THEN 'pending' ELSE 'delivered' END,
               CASE WHEN g %% 100 = 0 THEN NULL ELSE now() END,
               CASE WHEN g %% 200 = 100 THEN 1 ELSE 0 END,
               now() - (20001 - g) * interval '1 second', now() - (20001 - g) * interval '1 second'
        FROM generate_series(1, 20000) AS g
        """,
        eps[0],
        DEST,
    )
    sql(db_url, "ANALYZE outbox_deliveries")
    statement = render_ops(queries.STATUS_ENDPOINTS, "public").replace("$1", "50")
    [(plan,)] = sql(db_url, "EXPLAIN (FORMAT JSON) " + statement)
    used = {(n.get("Node Type"), n.get("Relation Name"), n.get("Index Name")) for n in nodes(plan)}
    assert {i for _, _, i in used} >= {
        "outbox_deliveries_fresh_idx",
        "outbox_deliveries_waiting_idx",
    }, used
    assert "outbox_deliveries_endpoint_idx" not in {i for _, _, i in used}, used
    assert ("Seq Scan", "outbox_deliveries", None) not in used, used
    [row, *_] = cli_json(db_url, "status")["endpoints"]
    assert row["pending"] == 200
    # The oldest pending delivery (g = 100, about 19,900 s old) waits: claimed before.
    assert 19_850 < row["oldest_pending_age_s"] < 20_000, row


def nodes(plan: Any) -> list[dict[str, Any]]:
    """Every node of an EXPLAIN (FORMAT JSON) plan, its subplans and CTEs included."""
    stack = [plan[0]["Plan"] if isinstance(plan, list) else plan]
    found = []
    while stack:
        node = stack.pop()
        found.append(node)
        stack.extend(node.get("Plans", []))
    return found


def test_status_fails_on_an_enabled_endpoints_old_pending_delivery(db_url: str) -> None:
    """Events of endpoints destinations are delivered once fanned out: the alert must look at
    their deliveries, or a dead endpoint's backlog never trips it."""
    stuck, paused = endpoint(db_url), endpoint(db_url, enabled=False, reason="moved")
    for eid in (stuck, paused):
        delivery(db_url, event(db_url), eid, "pending", attempts=3, age="2 hours")
    result = cli(db_url, "status", "--fail-if-pending-older-than", "1h")
    assert result.exit_code == EXIT_CONDITION, result.output
    assert f"endpoint {stuck}" in result.output and f"endpoint {paused}" not in result.output
    assert cli(db_url, "status", "--fail-if-pending-older-than", "3h").exit_code == 0


async def test_a_replay_that_commits_during_a_retention_run_keeps_its_event(db_url: str) -> None:
    """Retention decides what a delivery still needs in a snapshot; a replay committing after
    that snapshot reopens a delivery of an event retention was about to delete. The lock on
    the candidates and a DELETE in a snapshot of its own keep it (one statement lost it)."""
    import time

    from relay.db.store import Store, create_pool

    ep = endpoint(db_url)
    sql(
        db_url,
        "INSERT INTO outbox (destination, payload, content_type, status, attempts, delivered_at)"
        " SELECT %s, '{}', 'application/json', 'delivered', 1,"
        " now() - interval '2 days' + g * interval '1 ms' FROM generate_series(1, 300000) g",
        DEST,
    )
    [(target,)] = sql(db_url, "SELECT max(id) FROM outbox")
    delivery(db_url, target, ep, "delivered")
    sql(db_url, "ANALYZE")
    pool = await create_pool(to_asyncpg_dsn(db_url), "r", 2)
    replayer = await asyncpg.connect(to_asyncpg_dsn(db_url))
    try:
        store = Store(pool, "public", "r", 30.0)
        replay = replayer.transaction()
        await replay.start()
        # What admin.replay_event does: the event locked, its delivery pending again.
        await replayer.execute(render_ops(replay_queries.REPLAY_EVENT_ROW, "public"), target)
        await replayer.execute(
            "UPDATE outbox_deliveries SET status = 'pending', replay = true, attempts = 0, "
            "finished_at = NULL WHERE event_id = $1",
            target,
        )
        started = time.monotonic()
        retention = asyncio.create_task(store.delete_finished(3600, 400_000, 30 * 86400, None))
        await asyncio.sleep(0.15)  # its statement has its snapshot, and reads the old rows
        await replay.commit()
        batch = await retention
        took = time.monotonic() - started
    finally:
        await replayer.close()
        await pool.close()
    assert took > 0.3, f"retention ended before the replay committed ({took:.2f} s)"
    assert batch is not None and batch.deleted == 300_000 - 1
    assert sql(db_url, "SELECT id FROM outbox") == [(target,)]


async def test_a_dead_relays_expired_rows_do_not_hold_their_endpoints_room(db_url: str) -> None:
    """max_concurrency counts deliveries in flight on every relay, but not those of a relay
    that died (lease expired, not reaped yet): they would hold the endpoint until the
    reaper came round. Live ones count."""
    from relay.db.store import Store, create_pool
    from relay.sinks.endpoints.store import DeliveryStore

    ep = endpoint(db_url)
    events = [event(db_url) for _ in range(9)]
    for e in events[:3]:
        delivery(db_url, e, ep, "running", locked_by="dead-relay")
    sql(db_url, "UPDATE outbox_deliveries SET locked_until = now() - interval '10 s'")
    delivery(db_url, events[3], ep, "running", locked_by="live-relay")  # leased 30 s
    for e in events[4:]:
        delivery(db_url, e, ep, "pending")
    pool = await create_pool(to_asyncpg_dsn(db_url), "alive", 2)
    try:
        store = DeliveryStore(Store(pool, "public", "alive", 30.0))
        claimed, _, _ = await store.claim([DEST], [4], [4], 100, [], 1000, None, {ep: 4})
    finally:
        await pool.close()
    assert len(claimed) == 3  # 4 less the live relay's one


async def test_a_fast_endpoint_held_by_no_other_relay_is_claimed_ahead(db_url: str) -> None:
    """Claim ahead (#29): an endpoint known to be fast is claimed for ``ahead`` times its
    room, its next requests waiting in the relay's own request slots; never one another
    relay has deliveries of in flight (max_concurrency holds across relays: that relay sees
    these running and takes none), nor a rate-limited one, nor one not yet known."""
    from relay.db.store import Store, create_pool
    from relay.sinks.endpoints.fairness import UNCAPPED
    from relay.sinks.endpoints.store import DeliveryStore

    fast, shared, mine, limited, new = (endpoint(db_url) for _ in range(5))
    sql(db_url, "UPDATE outbox_endpoints SET rate_limit = 100 WHERE id = %s", limited)
    for ep in (fast, shared, mine, limited, new):
        for _ in range(30):
            delivery(db_url, event(db_url), ep, "pending")
    delivery(db_url, event(db_url), shared, "running", locked_by="other-relay")
    caps = {fast: UNCAPPED, shared: UNCAPPED, mine: UNCAPPED, limited: UNCAPPED}  # new: unknown
    pool = await create_pool(to_asyncpg_dsn(db_url), "ahead", 2)
    try:
        store = DeliveryStore(Store(pool, "public", "ahead", 30.0))
        # 3 in flight on this relay (it claimed them): ahead all the same, less those.
        others = [fast, shared, limited, new]
        first, _, _ = await store.claim([DEST], [4], [2], 500, others, 1000, None, {mine: 3})
        assert [c.endpoint_id for c in first] == [mine] * 3
        claimed, _, _ = await store.claim([DEST], [4], [2], 500, [], 1000, None, caps, (), 4)
        again, _, _ = await store.claim([DEST], [4], [2], 500, [], 1000, None, caps, (), 4)
    finally:
        await pool.close()
    per_endpoint = {ep: sum(1 for c in claimed if c.endpoint_id == ep) for ep in caps}
    per_endpoint[new] = sum(1 for c in claimed if c.endpoint_id == new)
    assert per_endpoint == {fast: 16, shared: 3, mine: 13, limited: 4, new: 2}
    # Its own rows in flight count against its room ahead: nothing more until they end.
    assert [c.endpoint_id for c in again] == []


async def test_retention_and_a_replay_of_an_endpoints_window_do_not_deadlock(
    db_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Retention locks events and then deletes old deliveries; `replay --endpoint --since`
    locks deliveries and then their events. The message log is purged in a transaction of
    its own, skipping what a replay holds: neither waits for the other in a circle. (The
    replay is started inside retention's first transaction, to make the two overlap.)"""
    from relay.db.retention import Retention
    from relay.db.store import Store, create_pool

    ep = endpoint(db_url)
    e = event(db_url)
    sql(db_url, "UPDATE outbox SET delivered_at = now() - interval '10 days' WHERE id = %s", e)
    delivery(db_url, e, ep, "delivered", age="10 days")
    sql(db_url, "UPDATE outbox_deliveries SET finished_at = now() - interval '10 days'")
    pool = await create_pool(to_asyncpg_dsn(db_url), "r", 2)
    replayer = await asyncpg.connect(to_asyncpg_dsn(db_url))
    replays: list[asyncio.Task[Any]] = []
    original = Retention._delete_locked_rows

    async def overlapped(self: Retention, conn: Any, ids: Any, status: Any) -> int:
        n = await original(self, conn, ids, status)
        if not replays:
            replays.append(
                asyncio.create_task(
                    admin.replay_endpoint(replayer, "public", ep, 30 * 86400, failed_only=False)
                )
            )
            await asyncio.sleep(0.5)  # the replay now waits for the event retention holds
        return n

    monkeypatch.setattr(Retention, "_delete_locked_rows", overlapped)
    try:
        batch = await Store(pool, "public", "r", 30.0).delete_finished(86400, 500, 86400, None)
        replayed = await replays[0]
    finally:
        await replayer.close()
        await pool.close()
    assert batch is not None and batch.deleted >= 1  # the event, gone before the replay
    assert replayed["replayed"] == 0  # it found its event deleted: nothing to send


async def test_the_claims_cost_does_not_grow_with_the_caps_it_is_given(db_url: str) -> None:
    """A relay sends the claim a cap for every endpoint it knows (thousands); looked up in an
    array for each endpoint walked, 10,000 of them made an empty claim 60 times slower (1.4 s
    against 23 ms). Compared in one test, with a wide margin: a ratio, not a speed target."""
    import time

    from relay.db.store import Store, create_pool
    from relay.sinks.endpoints.fairness import UNCAPPED
    from relay.sinks.endpoints.store import DeliveryStore

    n = 2000
    sql(
        db_url,
        "INSERT INTO outbox_endpoints (destination, url, secret) SELECT %s, "
        "'http://127.0.0.1:9/' || g, %s FROM generate_series(1, %s) g",
        DEST,
        SECRET,
        n,
    )
    sql(
        db_url,
        "INSERT INTO outbox_deliveries (event_id, endpoint_id, destination, run_after) "
        "SELECT e.id, e.id, %s, now() + interval '1 hour' FROM outbox_endpoints AS e",
        DEST,
    )
    sql(db_url, "ANALYZE")
    pool = await create_pool(to_asyncpg_dsn(db_url), "r", 2)
    try:
        store = DeliveryStore(Store(pool, "public", "r", 30.0))

        async def best(caps: dict[int, int]) -> float:
            times = []
            for _ in range(3):
                t = time.perf_counter()
                claimed, _, _ = await store.claim([DEST], [4], [1], 100, [], n, None, caps)
                times.append(time.perf_counter() - t)
                assert claimed == []  # every endpoint walked, nothing due
            return min(times)

        none = await best({})
        many = await best({i: UNCAPPED for i in range(1, 20_001)})
    finally:
        await pool.close()
    assert many < 5 * none + 0.05, (none, many)
