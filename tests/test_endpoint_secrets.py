"""Endpoint secrets at rest (issue #26, item 6): a writer without the key never stores a
plaintext secret where secrets are encrypted, OUTBOX_ENDPOINT_SECRET_REQUIRE refuses plaintext
everywhere, plaintext is said out loud, `endpoints reencrypt` moves every secret under a new
key, and `--secret-file` keeps a secret out of argv. Real database, real commands (a process
where the point is another process's environment)."""

from __future__ import annotations

import asyncio
import base64
import json
import os
import subprocess
import sys
from collections.abc import AsyncIterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import psycopg
import pytest
from click.testing import CliRunner, Result
from cryptography.fernet import Fernet
from sqlalchemy import create_engine, text
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine
from structlog.testing import capture_logs

from outbox import OutboxError
from outbox.dburl import to_sqlalchemy_async_url
from outbox.endpoints import Endpoints
from relay.cli import main

LOCAL = "http://127.0.0.1:9/in"
GIVEN = "whsec_" + base64.b64encode(bytes(range(32))).decode()
KEY_VAR = "OUTBOX_ENDPOINT_SECRET_KEY"
REQUIRE_VAR = "OUTBOX_ENDPOINT_SECRET_REQUIRE"


@pytest.fixture(autouse=True)
def no_key_here(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every test says which key it has; none comes from the developer's shell."""
    monkeypatch.delenv(KEY_VAR, raising=False)
    monkeypatch.delenv(REQUIRE_VAR, raising=False)


@pytest.fixture
async def aengine(db_url: str) -> AsyncIterator[AsyncEngine]:
    engine = create_async_engine(to_sqlalchemy_async_url(db_url))
    yield engine
    await engine.dispose()


def sql(db_url: str, query: str, *params: Any) -> list[tuple[Any, ...]]:
    with psycopg.connect(db_url, autocommit=True) as c:
        cur = c.execute(query, params or None)
        return cur.fetchall() if cur.description else []


def stored(db_url: str, endpoint_id: int) -> tuple[str, str | None]:
    [(secret, previous)] = sql(
        db_url, "SELECT secret, previous_secret FROM outbox_endpoints WHERE id = %s", endpoint_id
    )
    return secret, previous


def process(
    db_url: str, *args: str, env: dict[str, str] | None = None, input: str | None = None
) -> subprocess.CompletedProcess[str]:
    """`outbox-relay endpoints …` as a process of its own, with only ``env`` of ours (this
    interpreter's PYTHONPATH too, so that it runs this tree)."""
    base = {k: v for k, v in os.environ.items() if not k.startswith("OUTBOX_")}
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "relay.cli",
            "endpoints",
            args[0],
            "--database-url",
            db_url,
            *args[1:],
        ],
        capture_output=True,
        text=True,
        env={**base, **(env or {})},
        input=input,
        timeout=60,
    )


def cli(
    db_url: str, *args: str, env: dict[str, str] | None = None, input: str | None = None
) -> Result:
    return CliRunner(env=env).invoke(
        main, ["endpoints", args[0], "--database-url", db_url, *args[1:]], input=input
    )


async def create(engine: AsyncEngine, api: Endpoints, **kw: Any) -> Any:
    async with engine.begin() as c:
        return await api.create(c, destination="d", url=LOCAL, allow_private_networks=True, **kw)


# --- no plaintext where secrets are encrypted ---------------------------------------------


def test_a_cli_without_the_key_cannot_downgrade_an_encrypted_secret(db_url: str) -> None:
    """The issue's report: with the key set for the app and relays, an operator's shell without
    it rotated a secret and stored it in plaintext."""
    key = {KEY_VAR: Fernet.generate_key().decode()}
    added = process(db_url, "add", "d", LOCAL, "--allow-private-networks", "--json", env=key)
    assert added.returncode == 0, added.stderr
    endpoint_id = json.loads(added.stdout)["id"]
    before = stored(db_url, endpoint_id)
    assert before[0].startswith("enc:")

    keyless = process(db_url, "rotate-secret", str(endpoint_id))
    assert keyless.returncode == 1, keyless.stdout + keyless.stderr
    assert KEY_VAR in keyless.stderr and "encrypted" in keyless.stderr
    assert "Traceback" not in keyless.stderr and "whsec_" not in keyless.stdout
    assert stored(db_url, endpoint_id) == before  # unchanged: still enc:, no previous

    other = process(db_url, "add", "d", LOCAL, "--allow-private-networks")
    assert other.returncode == 1 and KEY_VAR in other.stderr
    assert sql(db_url, "SELECT count(*) FROM outbox_endpoints") == [(1,)]


async def test_a_writer_without_the_key_is_refused_where_secrets_are_encrypted(
    db_url: str, aengine: AsyncEngine
) -> None:
    plain, sealed = Endpoints(secret_key=""), Endpoints(secret_key=Fernet.generate_key().decode())
    old = await create(aengine, plain)  # a plaintext table so far: allowed
    new = await create(aengine, sealed)  # now it holds an encrypted secret
    async with aengine.connect() as c, c.begin():
        with pytest.raises(OutboxError, match=KEY_VAR) as caught:
            await plain.create(c, destination="d", url=LOCAL, allow_private_networks=True)
        assert "encrypted" in str(caught.value) and f"Set {KEY_VAR} to" in str(caught.value)
        # Rotating an endpoint whose own secret is still plaintext: refused as well, the
        # table holds encrypted ones.
        with pytest.raises(OutboxError, match=KEY_VAR):
            await plain.rotate_secret(c, old.id)
        with pytest.raises(OutboxError, match=KEY_VAR):
            await plain.rotate_secret(c, new.id)
        assert (await c.execute(text("SELECT 1"))).scalar() == 1  # the transaction is usable
    assert stored(db_url, old.id) == (old.secret, None)
    assert stored(db_url, new.id)[0].startswith("enc:")
    assert sql(db_url, "SELECT count(*) FROM outbox_endpoints") == [(2,)]

    engine = create_engine("postgresql+psycopg://" + db_url.partition("://")[2])
    try:  # the sync functions inherit it
        with engine.begin() as sc:
            with pytest.raises(OutboxError, match=KEY_VAR):
                plain.create_sync(sc, destination="d", url=LOCAL, allow_private_networks=True)
            with pytest.raises(OutboxError, match=KEY_VAR):
                plain.rotate_secret_sync(sc, old.id)
    finally:
        engine.dispose()
    assert stored(db_url, old.id) == (old.secret, None)
    assert sql(db_url, "SELECT count(*) FROM outbox_endpoints") == [(2,)]


async def test_a_keyless_rotation_waiting_on_an_encryption_of_its_row_is_refused(
    db_url: str, aengine: AsyncEngine
) -> None:
    """Two writers, one row: the keyed one encrypts it (not committed yet), the keyless one
    rotates it and waits for the row. Once the first commits, the second must see the row as
    it is now (encrypted) and be refused, not write plaintext over it."""
    plain, sealed = Endpoints(secret_key=""), Endpoints(secret_key=Fernet.generate_key().decode())
    ep = await create(aengine, plain)
    first = await aengine.connect()
    try:
        tx = await first.begin()
        await sealed.rotate_secret(first, ep.id)

        async def keyless() -> Any:
            async with aengine.begin() as c:
                await c.execute(text("SET LOCAL application_name = 'keyless-writer'"))
                # Dropping the previous secret at once: only the key can refuse it.
                return await plain.rotate_secret(c, ep.id, keep_previous=timedelta(0))

        second = asyncio.create_task(keyless())
        for _ in range(200):  # until the keyless rotation waits for the row's lock
            waiting = sql(
                db_url,
                "SELECT count(*) FROM pg_stat_activity "
                "WHERE datname = current_database() AND application_name = 'keyless-writer' "
                "AND wait_event_type = 'Lock'",
            )
            if waiting == [(1,)]:
                break
            await asyncio.sleep(0.02)
        else:
            pytest.fail("the keyless rotation never waited for the row")
        await tx.commit()
        with pytest.raises(OutboxError, match=KEY_VAR):
            await second
    finally:
        await first.close()
    assert stored(db_url, ep.id)[0].startswith("enc:")


async def test_a_keyed_rotation_encrypts_the_previous_secret_too(
    db_url: str, aengine: AsyncEngine
) -> None:
    """A table that was plaintext, now written with a key: the secret that keeps signing for
    a day is encrypted as well, not copied in clear beside the new one."""
    sealed = Endpoints(secret_key=Fernet.generate_key().decode())
    ep = await create(aengine, Endpoints(secret_key=""))
    async with aengine.begin() as c:
        new = await sealed.rotate_secret(c, ep.id)
    secret, previous = stored(db_url, ep.id)
    assert secret.startswith("enc:") and previous is not None and previous.startswith("enc:")
    assert sealed.box.open(secret) == new.secret and sealed.box.open(previous) == ep.secret


# --- requiring encryption -----------------------------------------------------------------


async def test_requiring_encryption_refuses_every_plaintext_write(
    db_url: str, aengine: AsyncEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    ep = await create(aengine, Endpoints())  # before it was required
    monkeypatch.setenv(REQUIRE_VAR, "1")
    required = Endpoints()  # reads the environment, as applications' defaults do
    async with aengine.connect() as c, c.begin():
        for write in (
            lambda: required.create(c, destination="d", url=LOCAL, allow_private_networks=True),
            lambda: required.rotate_secret(c, ep.id),
        ):
            with pytest.raises(OutboxError) as caught:
                await write()
            assert REQUIRE_VAR in str(caught.value) and KEY_VAR in str(caught.value)
    assert sql(db_url, "SELECT secret FROM outbox_endpoints") == [(ep.secret,)]
    # With the key it is written, encrypted.
    monkeypatch.setenv(KEY_VAR, Fernet.generate_key().decode())
    added = await create(aengine, Endpoints())
    assert stored(db_url, added.id)[0].startswith("enc:")
    # The setting says yes or no; anything else is an error naming it, not a silent "no".
    monkeypatch.setenv(REQUIRE_VAR, "sure")
    with pytest.raises(OutboxError, match=f"{REQUIRE_VAR}.*1 .*0"):
        await create(aengine, Endpoints())


def test_requiring_encryption_refuses_the_command_without_a_key(db_url: str) -> None:
    res = cli(db_url, "add", "d", LOCAL, "--allow-private-networks", env={REQUIRE_VAR: "1"})
    assert res.exit_code == 1, res.output
    assert REQUIRE_VAR in res.output and KEY_VAR in res.output
    assert sql(db_url, "SELECT count(*) FROM outbox_endpoints") == [(0,)]


# --- saying it out loud -------------------------------------------------------------------


async def test_a_plaintext_secret_is_logged_as_a_warning(aengine: AsyncEngine) -> None:
    plain, sealed = Endpoints(secret_key=""), Endpoints(secret_key=Fernet.generate_key().decode())
    with capture_logs() as logs:
        ep = await create(aengine, plain)
        async with aengine.begin() as c:
            await plain.rotate_secret(c, ep.id)
    events = [e for e in logs if e["event"] == "outbox.endpoints.secret_unencrypted"]
    assert [(e["log_level"], e["endpoint_id"]) for e in events] == [("warning", ep.id)] * 2
    assert KEY_VAR in events[0]["action"]
    with capture_logs() as logs:
        await create(aengine, sealed, secret=GIVEN)
    assert [e for e in logs if e["event"] == "outbox.endpoints.secret_unencrypted"] == []


def test_add_and_rotate_without_a_key_warn_on_stderr(db_url: str) -> None:
    res = cli(db_url, "add", "d", LOCAL, "--allow-private-networks", "--json")
    assert res.exit_code == 0, res.output
    ep = json.loads(res.stdout)  # stdout stays the JSON alone
    [line] = res.stderr.splitlines()
    assert line.startswith("outbox-relay: warning:") and KEY_VAR in line
    assert "unencrypted" in line
    rotated = cli(db_url, "rotate-secret", str(ep["id"]))
    assert rotated.exit_code == 0, rotated.output
    assert KEY_VAR in rotated.stderr and len(rotated.stderr.splitlines()) == 1
    key = {KEY_VAR: Fernet.generate_key().decode()}
    for args in (
        ["add", "e", LOCAL, "--allow-private-networks"],
        ["rotate-secret", str(ep["id"]), "--keep-previous-hours", "0"],
    ):
        quiet = cli(db_url, *args, env=key)
        assert quiet.exit_code == 0 and quiet.stderr == "", quiet.output


# --- re-encrypting under a new key --------------------------------------------------------


def _insert(db_url: str, secret: str, previous: str | None = None, until: str | None = None) -> int:
    [(endpoint_id,)] = sql(
        db_url,
        "INSERT INTO outbox_endpoints (destination, url, secret, previous_secret, "
        "previous_secret_until) VALUES ('d', %s, %s, %s, now() + CAST(%s AS interval)) "
        "RETURNING id",
        LOCAL,
        secret,
        previous,
        until,
    )
    return int(endpoint_id)


def _sealed(key: str, secret: str) -> str:
    return "enc:" + Fernet(key.encode()).encrypt(secret.encode()).decode()


def _opens(key: str, stored: str) -> str:
    assert stored.startswith("enc:"), stored
    return Fernet(key.encode()).decrypt(stored.removeprefix("enc:").encode()).decode()


def test_reencrypt_moves_every_secret_under_the_first_key(db_url: str) -> None:
    old, new, lost = (Fernet.generate_key().decode() for _ in range(3))
    a, b, c, d = (f"whsec_{base64.b64encode(bytes([n]) * 32).decode()}" for n in range(4))
    plain = _insert(db_url, a, b, "1 hour")  # from before any key: both in clear
    rotated = _insert(db_url, _sealed(old, c), _sealed(old, d), "1 hour")  # under the old key
    expired = _insert(db_url, _sealed(old, a), _sealed(old, b), "-1 hour")  # past its window
    current = _insert(db_url, _sealed(new, d))
    unknown = _insert(db_url, _sealed(lost, a))  # under a key nobody listed
    half = _insert(db_url, _sealed(new, b), _sealed(lost, c), "1 hour")
    untouched = {i: stored(db_url, i) for i in (current, unknown, half)}
    env = {KEY_VAR: f"{new},{old}"}

    res = process(db_url, "reencrypt", "--batch-size", "2", "--json", env=env)
    assert res.returncode == 1, res.stdout + res.stderr
    assert json.loads(res.stdout) == {
        "endpoints": 6,
        "encrypted": 2,
        "rewritten": 3,
        "expired_cleared": 1,
        "unreadable": [unknown, half],
    }
    assert f"endpoint(s) {unknown}, {half} open with none of the keys" in res.stderr
    assert KEY_VAR in res.stderr and "Traceback" not in res.stderr
    assert [_opens(new, v) for v in stored(db_url, plain)] == [a, b]  # type: ignore[arg-type]
    assert [_opens(new, v) for v in stored(db_url, rotated)] == [c, d]  # type: ignore[arg-type]
    assert _opens(new, stored(db_url, expired)[0]) == a
    assert sql(
        db_url,
        "SELECT previous_secret, previous_secret_until FROM outbox_endpoints WHERE id = %s",
        expired,
    ) == [(None, None)]
    # Left alone: what was current, and every secret of an endpoint a key is missing for.
    assert {i: stored(db_url, i) for i in untouched} == untouched

    # Again, with the missing key too: only what is left changes.
    again = process(db_url, "reencrypt", "--json", env={KEY_VAR: f"{new},{lost}"})
    assert again.returncode == 0, again.stderr
    assert json.loads(again.stdout) == {
        "endpoints": 6,
        "encrypted": 0,
        "rewritten": 2,
        "expired_cleared": 0,
        "unreadable": [],
    }
    done = process(db_url, "reencrypt", env={KEY_VAR: new})
    assert done.returncode == 0, done.stderr
    assert "6 endpoint(s): nothing to change" in done.stdout


def test_reencrypt_without_a_key_changes_nothing_and_says_what_to_set(db_url: str) -> None:
    endpoint_id = _insert(db_url, GIVEN)
    res = cli(db_url, "reencrypt")
    assert res.exit_code == 1 and KEY_VAR in res.output and "new,old" in res.output
    assert stored(db_url, endpoint_id) == (GIVEN, None)


# --- --secret-file ------------------------------------------------------------------------


def test_a_secret_from_a_file_or_standard_input_never_goes_through_argv(
    db_url: str, tmp_path: Path
) -> None:
    path = tmp_path / "secret"
    path.write_text(GIVEN + "\n")
    res = cli(db_url, "add", "d", LOCAL, "--allow-private-networks", "--secret-file", str(path))
    assert res.exit_code == 0, res.output
    assert GIVEN not in res.output and "--secret is visible" not in res.stderr
    [(first,)] = sql(db_url, "SELECT id FROM outbox_endpoints")
    assert stored(db_url, first) == (GIVEN, None)

    other = "whsec_" + base64.b64encode(bytes(range(1, 33))).decode()
    piped = cli(
        db_url,
        "rotate-secret",
        str(first),
        "--secret-file",
        "-",
        "--keep-previous-hours",
        "0",
        input=other + "\n",
    )
    assert piped.exit_code == 0, piped.output
    assert other not in piped.output and f"endpoint {first} now signs" in piped.stdout
    assert stored(db_url, first) == (other, None)

    argv = cli(db_url, "add", "d", LOCAL, "--allow-private-networks", "--secret", GIVEN)
    assert argv.exit_code == 0, argv.output
    assert "--secret is visible to other users" in argv.stderr and "--secret-file" in argv.stderr

    for args, status, said in (
        (["--secret", GIVEN, "--secret-file", str(path)], 2, "contradict"),
        (["--secret-file", str(tmp_path / "missing")], 2, "No such file"),
        (["--secret-file", "-"], 2, "is empty"),
    ):
        bad = cli(db_url, "add", "d", LOCAL, "--allow-private-networks", *args, input="")
        assert bad.exit_code == status and said in bad.output, bad.output
        assert GIVEN not in bad.output
    wrong = tmp_path / "wrong"
    wrong.write_text("not a secret")
    bad = cli(db_url, "add", "d", LOCAL, "--allow-private-networks", "--secret-file", str(wrong))
    assert bad.exit_code == 1 and "secret:" in bad.output
    assert sql(db_url, "SELECT count(*) FROM outbox_endpoints") == [(2,)]


# --- the relay ----------------------------------------------------------------------------


def relay_config(tmp_path: Path, db_url: str) -> Path:
    path = tmp_path / "relay.toml"
    path.write_text(
        f'database_url = "{db_url}"\n[http]\nenabled = false\n'
        '[destinations.customers]\nkind = "endpoints"\n'
    )
    return path


def test_the_secret_variables_are_known_to_the_relay_and_checked_by_run_check(
    db_url: str, tmp_path: Path
) -> None:
    config = str(relay_config(tmp_path, db_url))
    key = Fernet.generate_key().decode()
    ok = CliRunner(env={KEY_VAR: key, REQUIRE_VAR: "1"}).invoke(
        main, ["run", "--check", "--config", config]
    )
    assert ok.exit_code == 0, ok.output
    assert "not a setting" not in ok.output  # the dispatcher reads both: not "ignored"
    for env, said in (
        ({REQUIRE_VAR: "1"}, [REQUIRE_VAR, KEY_VAR]),
        ({REQUIRE_VAR: "maybe"}, [REQUIRE_VAR, "1"]),
        ({KEY_VAR: "not-a-key"}, [KEY_VAR, "Fernet"]),
    ):
        for args in (["run", "--check", "--config", config], ["run", "--config", config]):
            res = CliRunner(env=env).invoke(main, args)
            assert res.exit_code == 2, (args, env, res.output)
            assert all(s in res.output for s in said), res.output
            assert "Traceback" not in res.output and "configuration OK" not in res.output


@pytest.fixture
def dest_settings(db_url: str) -> Any:
    from tests.support.relays import settings

    return settings(
        db_url,
        "127.0.0.1:9",
        destinations={"customers": {"kind": "endpoints", "allow_private_networks": True}},
        relay={"poll_interval": 0.2, "lease": 5},
    )


async def test_a_relay_requiring_encryption_says_which_secrets_are_not(
    db_url: str, dest_settings: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Refusing to start would stop every destination, Kafka ones too, over rows the relay
    cannot rewrite: it starts, and says it as an error, naming the endpoints."""
    from tests.support.relays import running

    key = Fernet.generate_key().decode()
    clear = _insert(db_url, GIVEN)
    previous = _insert(db_url, _sealed(key, GIVEN), GIVEN, "1 hour")
    _insert(db_url, _sealed(key, GIVEN))
    monkeypatch.setenv(KEY_VAR, key)
    monkeypatch.setenv(REQUIRE_VAR, "1")
    with capture_logs() as logs:
        async with running(dest_settings):
            pass
    [event] = [e for e in logs if e["event"] == "relay.endpoints.secrets_unencrypted"]
    assert event["log_level"] == "error" and event["endpoints"] == 2
    assert event["ids"] == [clear, previous] and "reencrypt" in event["action"]

    monkeypatch.delenv(REQUIRE_VAR)  # not required: nothing said
    with capture_logs() as logs:
        async with running(dest_settings):
            pass
    assert [e for e in logs if e["event"] == "relay.endpoints.secrets_unencrypted"] == []


def test_a_relay_requiring_encryption_without_the_key_refuses_to_start(
    dest_settings: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from relay.app import Relay

    monkeypatch.setenv(REQUIRE_VAR, "1")
    with pytest.raises(OutboxError, match=f"{REQUIRE_VAR}.*{KEY_VAR}"):
        Relay(dest_settings)


async def test_previous_secrets_past_their_window_are_cleared(db_url: str) -> None:
    import asyncpg

    from outbox.dburl import to_asyncpg_dsn
    from relay.db.store import Store, create_pool
    from relay.sinks.endpoints.at_rest import clear_expired_previous_secrets

    expired = [_insert(db_url, GIVEN, GIVEN, "-1 second") for _ in range(3)]
    valid = _insert(db_url, GIVEN, GIVEN, "1 hour")
    [(no_until,)] = sql(
        db_url,
        "INSERT INTO outbox_endpoints (destination, url, secret, previous_secret) "
        "VALUES ('d', 'u', %s, %s) RETURNING id",
        GIVEN,
        GIVEN,
    )
    pool = await create_pool(to_asyncpg_dsn(db_url), "clear-test", 2)
    listener = await asyncpg.connect(to_asyncpg_dsn(db_url))
    heard: list[str] = []
    await listener.add_listener("public.outbox", lambda *a: heard.append(a[3]))
    try:
        store = Store(pool, "public", "clear-test", 30.0)
        assert await clear_expired_previous_secrets(store, batch_size=2) == 4
        rows = sql(
            db_url,
            "SELECT id, previous_secret, previous_secret_until IS NULL FROM outbox_endpoints "
            "ORDER BY id",
        )
        assert rows == [(i, None, True) for i in [*expired]] + [(valid, GIVEN, False)] + [
            (no_until, None, True)
        ]
        await asyncio.sleep(0.2)
        assert heard  # the relays re-read the endpoints' keys
        heard.clear()
        assert await clear_expired_previous_secrets(store) == 0
        await asyncio.sleep(0.2)
        assert heard == []  # nothing to clear: no statement that would wake every relay
    finally:
        await listener.close()
        await pool.close()


async def test_the_relays_retention_clears_expired_previous_secrets(db_url: str) -> None:
    from tests.support.relays import running, settings, wait_until

    expired = _insert(db_url, GIVEN, GIVEN, "-1 second")
    valid = _insert(db_url, GIVEN, GIVEN, "1 hour")
    s = settings(
        db_url,
        "127.0.0.1:9",
        destinations={"d": {"kind": "endpoints", "allow_private_networks": True}},
        relay={"retention_interval": 0.1},
    )

    def previous() -> dict[int, Any]:
        return dict(sql(db_url, "SELECT id, previous_secret FROM outbox_endpoints"))

    async with running(s):
        await wait_until(lambda: previous()[expired] is None, timeout=10, what="cleared")
    assert previous()[valid] == GIVEN
