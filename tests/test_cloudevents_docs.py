"""docs/cloudevents.md's "Example: webhooks, end to end" runs as the page shows it, against the
real services: relay.toml, receiver.py and enqueue.py written from the page's blocks (by
run_page, which also checks the page's fragments), then the commands of its shell block in
order: the secret made, the database migrated, the receiver started in the background, the
two events enqueued, the relay run until the receiver has printed both and then stopped with
Ctrl-C (SIGINT). What the receiver printed is compared with what the page shows: each line's
id, type and data; of the time (the rows' created_at) its format, and that the two events
share it (one transaction).

What the test changes, and nothing else (tests/support/doc_programs.py): tests run side by
side (pytest-xdist workers) and cannot share the page's fixed database and ports, so
- the database URL `postgresql://root@127.0.0.1:5432/ce_demo`, in relay.toml, in enqueue.py
  and in the `migrate` command, names a fresh, empty database of the test's own, which the
  test makes in place of the block's `createdb -h 127.0.0.1 ce_demo`;
- the receiver's port 8000, in relay.toml's `url` and in receiver.py, is a free port;
- the relay's metrics listener, which the page leaves on its default port 9090, is on a free
  one (`OUTBOX_HTTP_PORT=0` in the relay's environment).

The block has a job in the background (`&`) and a command that runs until Ctrl-C, so the test
runs its lines one by one rather than the block whole, and holds the block to exactly the
commands it runs (COMMANDS): a command edited on the page fails here until the test runs it.

The page's "Reading them from Kafka" block stays a fragment: it joins the consumer group
`billing` at the topic's latest offset and reads forever, so it sees only events relayed after
its group join (about 5 s on the test broker, with no sign of when that is done outside the
function); running it would mean changing its own arguments, not only where it connects.
"""

from __future__ import annotations

import re
import shlex
import subprocess
from pathlib import Path

import pytest

from relay.tools.localbroker import free_port
from tests.support.doc_programs import (
    Program,
    command_lines,
    listening,
    substitute,
    wait_for,
)
from tests.support.doc_runner import broken_copy, environment, run_page
from tests.support.markdown import Block, blocks

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "cloudevents.md"
PAGE_DB = "postgresql://root@127.0.0.1:5432/ce_demo"
PAGE_PORT = 8000
# The shell block's commands, as the test runs them (the second: the test's own database).
COMMANDS = [
    'export ORDERS_WEBHOOK_SECRET="whsec_$(openssl rand -base64 32)"',
    "createdb -h 127.0.0.1 ce_demo",
    f"outbox-relay migrate --database-url {PAGE_DB}",
    "python receiver.py &",
    "python enqueue.py",
    "outbox-relay run --config relay.toml",
]
# How the receiver prints an event's time: str() of an aware datetime in UTC, which leaves out
# the fraction when the microseconds are 0.
TIME = re.compile(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d(\.\d{6})?\+00:00")


def example(page: Path) -> tuple[Block, list[str]]:
    """The walkthrough's shell block (the one after enqueue.py) and the lines the page shows
    the receiver printing (the block after it)."""
    found = blocks(page)
    at = next(i for i, b in enumerate(found) if b.file == "enqueue.py")
    shell, shown = found[at + 1], found[at + 2]
    assert shell.lang == "sh" and shown.lang == "", (shell, shown)
    return shell, shown.code.splitlines()


def walk(page: Path, work: Path, db_url: str) -> tuple[list[str], list[str]]:
    """Does what ``page``'s walkthrough says, in ``work``; what the receiver printed, and what
    the page shows it printing."""
    run_page(page, work, "postgresql://docs@localhost/unused")  # runs nothing: no run block
    shell, shown = example(page)
    lines = command_lines(shell)
    assert lines == COMMANDS, f"{page.name}:{shell.line}: the test runs {COMMANDS}"
    port = free_port()
    url = f"http://127.0.0.1:{PAGE_PORT}/"
    substitute(work / "relay.toml", {PAGE_DB: db_url, url: url.replace(str(PAGE_PORT), str(port))})
    substitute(work / "receiver.py", {f'("127.0.0.1", {PAGE_PORT})': f'("127.0.0.1", {port})'})
    substitute(work / "enqueue.py", {PAGE_DB: db_url})
    for name in ("relay.toml", "receiver.py", "enqueue.py"):
        text = (work / name).read_text()
        assert "ce_demo" not in text and str(PAGE_PORT) not in text, f"{name}: more to replace"

    env = environment(work, db_url)
    made = subprocess.run(
        ["bash", "-c", f'{lines[0]}\nprintf %s "$ORDERS_WEBHOOK_SECRET"'],
        capture_output=True,
        text=True,
        check=True,
    )
    assert made.stdout.startswith("whsec_") and len(made.stdout) > 40, made
    env["ORDERS_WEBHOOK_SECRET"] = made.stdout
    # lines[1], createdb: the test's own database, empty as createdb makes it (the fixture).
    run(lines[2].replace(PAGE_DB, db_url), work, env)
    with Program(
        "receiver", shlex.split(lines[3].removesuffix("&")), work, env, quiet=True
    ) as receiver:
        wait_for(lambda: listening(port), timeout=15, what="listening", watch=[receiver])
        run(lines[4], work, env)
        relay_env = {**env, "OUTBOX_HTTP_PORT": "0"}
        with Program("relay", shlex.split(lines[5]), work, relay_env, quiet=False) as relay:
            wait_for(
                lambda: len(receiver.out().splitlines()) >= len(shown),
                timeout=30,
                what="both events printed",
                watch=[receiver, relay],
            )
            assert relay.interrupt() == 0, relay.output()
        return receiver.out().splitlines(), shown


def run(command: str, work: Path, env: dict[str, str]) -> None:
    res = subprocess.run(
        shlex.split(command), cwd=work, env=env, capture_output=True, text=True, timeout=60
    )
    assert res.returncode == 0, f"{command} exited {res.returncode}:\n{res.stdout}{res.stderr}"


def fields(line: str) -> tuple[tuple[str, str, str], str]:
    """A printed line's id, type and data, and its time."""
    id_, type_, day, clock, data = line.split(" ", 4)
    return (id_, type_, data), f"{day} {clock}"


def compare(got: list[str], shown: list[str]) -> None:
    assert all(TIME.fullmatch(fields(line)[1]) for line in shown), shown
    # The relay may have the two requests in flight together: compared in the order of ids.
    assert len(got) == len(shown), got
    assert [fields(line)[0] for line in sorted(got)] == [fields(line)[0] for line in shown], got
    times = {fields(line)[1] for line in got}
    assert len(times) == 1 and TIME.fullmatch(times.pop()), got


def test_the_webhook_example_runs(empty_db_url: str, tmp_path: Path) -> None:
    compare(*walk(PAGE, tmp_path, empty_db_url))


@pytest.mark.parametrize(
    ("old", "new", "failure"),
    [
        # The SDK's function renamed: the check of the files names it before anything runs.
        ("from_http", "from_https", r"import from_https`: no such name"),
        # Only where it is called: the receiver fails on the relay's first request.
        ("event = from_http(", "event = from_htp(", r"(?s)receiver failed.*NameError"),
        # Another type: the receiver prints what the page does not show.
        (
            'event_type="com.shop.order.created",',
            'event_type="com.shop.order.placed",',
            r"com\.shop\.order\.placed",
        ),
    ],
    ids=["renamed", "misspelt-call", "other-type"],
)
def test_a_broken_example_fails(
    empty_db_url: str, tmp_path: Path, old: str, new: str, failure: str
) -> None:
    broken, work = broken_copy(PAGE, tmp_path, old, new)
    with pytest.raises(AssertionError, match=failure):
        compare(*walk(broken, work, empty_db_url))
