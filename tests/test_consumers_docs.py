"""docs/consumers.md's complete Kafka consumer, billing.py, runs as the page shows it, against
PostgreSQL and the test broker: written from its block (by run_page, which also checks the
page's other blocks, all fragments), started as its docstring says
(`DATABASE_URL=… KAFKA_BOOTSTRAP=… python billing.py`, with the test's database and broker),
while the relay sends order.created events to its topic, each twice (put back to pending once
delivered, as a relay that died before recording would). It reads them all (its group's
committed offsets reach the last record of each partition), writes one invoice per order and
one inbox mark per event, and stops on Ctrl-C.

What the test changes in billing.py, and nothing else (tests/support/doc_programs.py): its
topic `shop.orders.v1` and its group `billing` are the test's own, since tests run side by side
and one after another on one broker, and another run's records or committed offsets would
reach this one. Its database and broker come from the environment, as on the page. The
consumer's database is the outbox's here (the page gives it one of its own: its tables are
apart from the outbox's either way). Its group join takes about 5 s on the test broker.

The page's other programs stay fragments: hooks.py, the FastAPI receiver, which runs under
uvicorn behind the relay's webhooks; the cost script, a benchmark (20,000 events per run).
"""

from __future__ import annotations

import ast
import re
import shlex
import uuid
from decimal import Decimal
from pathlib import Path

import asyncpg
import pytest
from aiokafka import AIOKafkaConsumer, TopicPartition

import outbox
from outbox.dburl import to_asyncpg_dsn, to_sqlalchemy_async_url
from tests.support.doc_programs import Program, substitute
from tests.support.doc_runner import broken_copy, environment, run_page
from tests.support.kafka import consume
from tests.support.relays import running, settings, status_counts, wait_until

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "consumers.md"
TOPIC, GROUP = "shop.orders.v1", "billing"
ORDERS = 5
_ASSIGNMENT = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*)=(.*)$")


def command(program: Path) -> tuple[dict[str, str], list[str]]:
    """The command line that ``program``'s docstring ends with: its variables, its words."""
    doc = ast.get_docstring(ast.parse(program.read_text()))
    assert doc, f"{program.name} has no docstring"
    words = shlex.split(doc.strip().splitlines()[-1])
    variables: dict[str, str] = {}
    while words and (m := _ASSIGNMENT.match(words[0])):
        variables[m[1]] = m[2]
        words.pop(0)
    return variables, words


async def walk(page: Path, work: Path, db_url: str, bootstrap: str) -> list[int]:
    """billing.py run as ``page`` says, while the relay sends every event twice, until it has
    read and committed every record, then stopped with Ctrl-C; the events' ids."""
    run_page(page, work, db_url)
    program = work / "billing.py"
    variables, argv = command(program)
    assert sorted(variables) == ["DATABASE_URL", "KAFKA_BOOTSTRAP"], variables
    assert argv == ["python", "billing.py"], argv
    assert variables["DATABASE_URL"].startswith("postgresql+asyncpg://"), variables
    ours = {"DATABASE_URL": to_sqlalchemy_async_url(db_url), "KAFKA_BOOTSTRAP": bootstrap}
    topic, group = f"{TOPIC}.{uuid.uuid4().hex[:8]}", f"{GROUP}-{uuid.uuid4().hex[:8]}"
    substitute(program, {f'"{TOPIC}"': f'"{topic}"', f'group_id="{GROUP}"': f'group_id="{group}"'})
    env = environment(work, db_url, ours)
    with Program("billing", argv, work, env, quiet=False) as billing:
        ids = await relay_twice(db_url, bootstrap, topic, billing)
        await wait_committed(bootstrap, topic, group, billing)
        billing.interrupt()
    return ids


async def relay_twice(db_url: str, bootstrap: str, topic: str, billing: Program) -> list[int]:
    """ORDERS order.created events enqueued, and relayed to ``topic`` twice."""

    async def delivered() -> bool:
        billing.check()
        return (await status_counts(db_url)).get("delivered", 0) == ORDERS

    conn = await asyncpg.connect(to_asyncpg_dsn(db_url))
    try:
        async with conn.transaction():
            ids = await outbox.enqueue_many(
                conn,
                [
                    {
                        "destination": "orders",
                        "payload": {"id": n, "total": f"{n}.90"},
                        "event_type": "order.created",
                    }
                    for n in range(1, ORDERS + 1)
                ],
            )
        async with running(settings(db_url, bootstrap, topic=topic)):
            await wait_until(delivered, what="delivered once")
            await conn.execute("UPDATE outbox SET status = 'pending', run_after = now()")
            await wait_until(delivered, what="delivered again")
    finally:
        await conn.close()
    return ids


async def wait_committed(bootstrap: str, topic: str, group: str, billing: Program) -> None:
    """Until ``group`` has committed every record of ``topic``: read and applied."""
    records = await consume(bootstrap, topic, count=2 * ORDERS)
    assert len(records) == 2 * ORDERS, records
    # Where each partition ends: after its last record (the test broker's end offsets count
    # record batches, not records).
    ends = {r.partition: r.offset + 1 for r in sorted(records, key=lambda r: r.offset)}
    reader = AIOKafkaConsumer(bootstrap_servers=bootstrap, group_id=group, enable_auto_commit=False)
    await reader.start()
    try:

        async def committed() -> bool:
            billing.check()
            got = [await reader.committed(TopicPartition(topic, p)) for p in ends]
            return got == list(ends.values())

        await wait_until(committed, timeout=30, interval=0.2, what="every record committed")
    finally:
        await reader.stop()


async def test_billing_py_applies_each_event_once(
    db_url: str, kafka_bootstrap: str, tmp_path: Path
) -> None:
    ids = await walk(PAGE, tmp_path, db_url, kafka_bootstrap)
    conn = await asyncpg.connect(to_asyncpg_dsn(db_url))
    try:
        invoices = await conn.fetch("SELECT order_id, total FROM invoices ORDER BY order_id")
        marks = await conn.fetch("SELECT consumer, event_id FROM outbox_inbox ORDER BY 2")
    finally:
        await conn.close()
    # Two copies of every event read: one invoice each, and one mark.
    assert [tuple(r) for r in invoices] == [(n, Decimal(f"{n}.90")) for n in range(1, ORDERS + 1)]
    assert sorted((r[0], int(r[1])) for r in marks) == [("billing", i) for i in sorted(ids)]


@pytest.mark.parametrize(
    ("old", "new", "failure"),
    [
        # Its import misspelt: the check of the page's files names it before anything runs.
        (
            "import KafkaInbox",
            "import KafkaInboxes",
            r"import KafkaInboxes`: no such name",
        ),
        # The line the page calls required: KafkaInbox refuses the consumer, billing.py exits.
        (
            "enable_auto_commit=False,",
            "enable_auto_commit=True,",
            r"(?s)billing exited 1:.*auto",
        ),
    ],
    ids=["renamed", "auto-commit"],
)
async def test_a_broken_example_fails(
    db_url: str, kafka_bootstrap: str, tmp_path: Path, old: str, new: str, failure: str
) -> None:
    broken, work = broken_copy(PAGE, tmp_path, old, new)
    with pytest.raises(AssertionError, match=failure):
        await walk(broken, work, db_url, kafka_bootstrap)
