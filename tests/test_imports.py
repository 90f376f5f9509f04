"""Commands load only what they use: the operations commands start fast, and the library's
package does not load SQLAlchemy until an application uses it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
HEAVY = ("sqlalchemy", "aiokafka", "httptools", "uvloop", "httpx", "relay.app", "relay.tools")


def imported(code: str) -> set[str]:
    """The modules loaded by the time ``code`` (run in a fresh interpreter) has finished,
    however they were imported."""
    dump = "import atexit, sys; atexit.register(lambda: print(*sys.modules, file=sys.stderr))"
    done = subprocess.run(
        [sys.executable, "-c", f"{dump}\n{code}"], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return set(done.stderr.split())


@pytest.mark.parametrize("command", ["status", "retry", "pause", "migrate"])
def test_an_operations_command_loads_neither_the_relay_nor_its_clients(command: str) -> None:
    modules = imported(f"from relay.cli import main; main([{command!r}, '--help'])")
    assert "relay.cli.ops" in modules or "relay.cli.run" in modules  # the command did load
    heavy = sorted(m for m in modules if m.split(".")[0] in HEAVY or m.startswith(HEAVY))
    assert not heavy, heavy


def test_importing_the_library_loads_sqlalchemy_only_when_used() -> None:
    modules = imported("import outbox; outbox.Status; from outbox.dburl import redact")
    assert "outbox.status" in modules and "sqlalchemy" not in modules
    used = imported("import outbox; outbox.enqueue")
    assert {"sqlalchemy", "outbox.writer"} <= used


def test_enqueue_without_a_catalog_loads_neither_its_validator_nor_pydantic(db_url: str) -> None:
    """An application that declares no catalog pays nothing for one (pyproject.toml's
    enqueue-without-catalog rule says the same of the code)."""
    url = "postgresql+psycopg://" + db_url.partition("://")[2]
    modules = imported(
        "import sqlalchemy as sa\n"
        "import outbox\n"
        f"engine = sa.create_engine({url!r})\n"
        "with engine.begin() as conn:\n"
        "    outbox.enqueue_sync(conn, destination='orders', payload={'id': 1},\n"
        "                        event_type='order.created')\n"
    )
    assert "outbox.writer" in modules
    loaded = sorted(m for m in modules if m.split(".")[0] in ("jsonschema_rs", "pydantic"))
    assert not loaded, loaded
    assert "outbox.catalog" not in modules


def test_a_catalog_needs_its_validator_only_when_a_type_checks() -> None:
    """jsonschema-rs, where installed, checks each schema as it is declared; without it, a
    catalog whose types are all off (and declare no example) declares and checks events."""
    declare = (
        "import sys\n"
        "sys.modules['jsonschema_rs'] = None  # as if not installed\n"
        "from outbox.catalog import Catalog, EventType\n"
        "from outbox.message import build_message\n"
        "c = Catalog(validate='{mode}')\n"
        "c.add(EventType.from_schema('t', {{'type': 'object'}}, destinations=['d']))\n"
        "try:\n"
        "    c.check(build_message(destination='d', payload={{}}, event_type='t'), {{}})\n"
        "except ModuleNotFoundError as exc:\n"
        "    print(exc)\n"
    )
    run = [sys.executable, "-c"]
    off = subprocess.run([*run, declare.format(mode="off")], capture_output=True, text=True)
    assert (off.returncode, off.stdout, off.stderr) == (0, "", "")
    reject = subprocess.run([*run, declare.format(mode="reject")], capture_output=True, text=True)
    assert "pip install 'outbox-relay[catalog]'" in reject.stdout, reject.stderr


def test_type_checkers_still_catch_a_misspelt_outbox_name(tmp_path: Path) -> None:
    """The lazy names stay visible to mypy as what they are: a typo is an error, not Any."""
    snippet = tmp_path / "uses_outbox.py"
    snippet.write_text(
        "import outbox\n"
        "from outbox import enqueue, Status\n"
        "status: Status = Status.PENDING\n"
        "outbox.enqeue\n"
        "from outbox import enqueue_synk\n"
    )
    cache = ROOT / ".mypy_cache"  # warm: ./scripts/test runs mypy first
    # A process of its own: mypy raises the interpreter's recursion limit and keeps it raised.
    done = subprocess.run(
        [sys.executable, "-m", "mypy", "--cache-dir", str(cache), "--strict", str(snippet)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
    )
    out, status = done.stdout + done.stderr, done.returncode
    assert status == 1, out
    assert 'Module has no attribute "enqeue"' in out, out
    assert 'Module "outbox" has no attribute "enqueue_synk"' in out, out
    assert out.count("error:") == 2, out  # the names that exist type-check


def test_the_library_at_work_loads_no_relay_module(db_url: str) -> None:
    """An application that enqueues, registers an endpoint (its URL and address checks) and
    verifies a webhook (the signing format) runs on `outbox` alone: the relay, its settings
    and its clients stay out of the application's process (pyproject.toml's import rules
    say the same of the code; this holds it for what an import does at run time)."""
    url = "postgresql+psycopg://" + db_url.partition("://")[2]
    aurl = "postgresql+asyncpg://" + db_url.partition("://")[2]
    modules = imported(
        "import sqlalchemy as sa\n"
        "import outbox\n"
        "from outbox.endpoints import Endpoints\n"
        "from outbox.endpoint_secrets import generate\n"
        "from outbox.inbox.webhooks import WebhookReceiver\n"
        f"engine = sa.create_engine({url!r})\n"
        "with engine.begin() as conn:\n"
        "    outbox.enqueue_sync(conn, destination='orders', payload={'id': 1})\n"
        "    Endpoints().create_sync(conn, destination='hooks', url='http://127.0.0.1:9/in',\n"
        "                            allow_private_networks=True)\n"
        "import asyncio, time\n"
        "from sqlalchemy.ext.asyncio import create_async_engine\n"
        "from outbox.webhooks.signing import Signer, decode_secret\n"
        "secret = generate()\n"
        "stamp, body = int(time.time()), b'{}'\n"
        "sig = Signer([decode_secret(secret)]).sign('msg_1', stamp, body)\n"
        "headers = {'webhook-id': 'msg_1', 'webhook-timestamp': str(stamp),\n"
        "           'webhook-signature': sig}\n"
        "assert WebhookReceiver(consumer='c', secrets=secret).verify(headers, body)\n"
        "async def later():\n"
        f"    aengine = create_async_engine({aurl!r})\n"
        "    async with aengine.begin() as conn:\n"
        "        await outbox.enqueue(conn, destination='orders', payload={'id': 2})\n"
        "        await Endpoints().create(conn, destination='hooks', url='http://127.0.0.1:9/b',\n"
        "                                 allow_private_networks=True)\n"
        "    await aengine.dispose()\n"
        "asyncio.run(later())\n"
        "with engine.connect() as conn:\n"
        "    n = conn.execute(sa.text('SELECT count(*) FROM outbox')).scalar()\n"
        "    e = conn.execute(sa.text('SELECT count(*) FROM outbox_endpoints')).scalar()\n"
        "    assert (n, e) == (2, 2), (n, e)\n"
    )
    assert {"outbox.writer", "outbox.endpoints", "outbox.webhooks.urls"} <= modules
    relay = sorted(m for m in modules if m == "relay" or m.startswith("relay."))
    assert not relay, relay
    assert "pydantic_settings" not in modules


def test_serving_the_console_loads_neither_sqlalchemy_nor_the_librarys_endpoints() -> None:
    # The console's endpoint actions load the library's endpoints (and SQLAlchemy) when one
    # runs, as relay.ops.endpoints does; a relay serving the console pays nothing for them
    # until then (a review found both loaded at start: +19 MB).
    modules = imported("import relay.app\nfrom relay.ui.app import build_console")
    assert "relay.ui.actions" in modules  # the console's actions did load
    assert not sorted(m for m in modules if m.split(".")[0] == "sqlalchemy")[:3]
    assert "outbox.endpoints" not in modules
