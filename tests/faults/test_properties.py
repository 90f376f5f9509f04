"""Property-based tests: the backoff schedule, config parsing of arbitrary TOML, and events of
arbitrary keys, headers and payloads arriving unchanged through Kafka and webhooks."""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import string
import uuid
from pathlib import Path
from typing import Any

import asyncpg
import pytest
import tomli_w
from hypothesis import HealthCheck, assume, example, given, settings
from hypothesis import strategies as st

import outbox
from outbox.dburl import to_asyncpg_dsn
from relay import backoff
from relay.config import Backoff, ConfigError, Settings
from relay.settings import load_settings
from relay.sinks.webhook.config import RESERVED_HEADERS
from tests.support.kafka import consume_ids, outbox_id
from tests.support.receiver import Receiver
from tests.support.relays import running, wait_until
from tests.support.relays import settings as relay_settings
from tests.webhook_helpers import SECRET, verify, verify_bytes

pytestmark = pytest.mark.slow

# --- backoff ---------------------------------------------------------------------------------

policies = st.builds(
    Backoff,
    base=st.floats(0.001, 1000),
    factor=st.floats(1, 10),
    max=st.floats(0.001, 100_000),
    jitter=st.floats(0, 1),
)


@settings(max_examples=300, deadline=None)
@given(policy=policies, attempts=st.integers(1, 3000), seed=st.integers(0, 2**32))
def test_backoff_is_monotone_up_to_the_cap_and_jitter_stays_inside(
    policy: Backoff, attempts: int, seed: int
) -> None:
    plain = policy.model_copy(update={"jitter": 0.0})
    d1, d2 = backoff.delay(plain, attempts), backoff.delay(plain, attempts + 1)
    assert 0 <= d1 <= d2 <= plain.max  # never shrinks, never above the cap
    jittered = backoff.delay(policy, attempts, random.Random(seed))
    assert d1 * (1 - policy.jitter) - 1e-9 <= jittered <= d1 * (1 + policy.jitter) + 1e-9


@settings(max_examples=200, deadline=None)
@given(schedule=st.lists(st.floats(0, 1e6), min_size=1, max_size=20), attempt=st.integers(1, 50))
def test_backoff_schedule_is_followed_then_repeats_its_last_entry(
    schedule: list[float], attempt: int
) -> None:
    policy = Backoff(schedule=schedule, jitter=0)
    assert backoff.delay(policy, attempt) == schedule[min(attempt, len(schedule)) - 1]


# --- config parsing never crashes ------------------------------------------------------------

KNOWN = [
    "database_url",
    "log_level",
    "relay",
    "kafka",
    "destinations",
    "http",
    "webhooks",
    "batch_size",
    "lease",
    "backoff",
    "schedule",
    "kind",
    "topic",
    "url",
    "secrets",
    "secret_env",
    "headers",
    "bootstrap_servers",
    "max_in_flight",
    "schema",
    "ordering",
    "_env_file",
    "_secrets_dir",
    "__init__",
    "model_config",
]
keys = st.one_of(st.sampled_from(KNOWN), st.text(max_size=12))
scalars = st.one_of(
    st.none(),  # dropped below: TOML has no null
    st.booleans(),
    st.integers(-(2**63), 2**63 - 1),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=30),
    st.sampled_from(["postgresql://u:p@h/db", "kafka", "webhook", "http://127.0.0.1/x", "all"]),
    st.datetimes(),
)
documents = st.recursive(
    st.dictionaries(keys, scalars, max_size=6),
    lambda inner: st.dictionaries(
        keys, st.one_of(scalars, inner, st.lists(scalars, max_size=4)), max_size=6
    ),
    max_leaves=30,
)


def _toml_ready(v: Any) -> Any:
    if isinstance(v, dict):
        return {k: _toml_ready(x) for k, x in v.items() if x is not None}
    if isinstance(v, list):
        return [_toml_ready(x) for x in v if x is not None]
    return v


@settings(
    max_examples=300,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(doc=documents, with_url=st.booleans())
def test_config_parsing_raises_only_config_error(
    doc: dict[str, Any], with_url: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in [n for n in __import__("os").environ if n.startswith("OUTBOX_")]:
        monkeypatch.delenv(name)
    if with_url:
        doc = {"database_url": "postgresql://u@127.0.0.1/db", **doc}
    try:
        text = tomli_w.dumps(_toml_ready(doc))
    except (TypeError, ValueError):
        assume(False)  # not expressible as TOML (tomli-w refuses it)
    path = tmp_path / f"{uuid.uuid4().hex}.toml"
    path.write_text(text)
    try:
        result = load_settings(path)
    except ConfigError as exc:
        assert str(exc)  # says something
    else:
        assert isinstance(result, Settings)


@settings(max_examples=100, deadline=None)
@given(raw=st.binary(max_size=200))
def test_config_parsing_of_arbitrary_bytes(raw: bytes, tmp_path_factory: Any) -> None:
    path = tmp_path_factory.mktemp("raw") / "relay.toml"
    path.write_bytes(raw)
    try:
        result = load_settings(path)
    except ConfigError as exc:
        assert str(exc)  # a message, never a traceback from the parser or pydantic
    else:
        # Only possible when the environment supplies the rest (OUTBOX_DATABASE_URL).
        assert isinstance(result, Settings)


# --- encoding round trips --------------------------------------------------------------------

no_nul = st.text(
    alphabet=st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00"), max_size=40
)
header_names = st.text(alphabet=string.ascii_letters + string.digits + "-_.", min_size=1)
payloads = st.one_of(
    st.binary(max_size=300),
    no_nul,
    st.dictionaries(no_nul, st.one_of(st.integers(), no_nul, st.booleans()), max_size=5),
)
event = st.fixed_dictionaries(
    {
        "key": st.one_of(st.none(), no_nul),
        "headers": st.dictionaries(
            header_names.filter(lambda n: n.lower() not in ("outbox-id", "content-type")),
            no_nul,
            max_size=4,
        ),
        "payload": payloads,
    }
)


def _stored(payload: Any) -> bytes:
    """The bytes enqueue stores for a payload (what must arrive)."""
    if isinstance(payload, bytes):
        return payload
    if isinstance(payload, str):
        return payload.encode()
    return json.dumps(payload, separators=(",", ":"), ensure_ascii=False).encode()


async def _delivered(db_url: str, ids: list[int]) -> bool:
    conn = await asyncpg.connect(to_asyncpg_dsn(db_url))
    try:
        n = await conn.fetchval(
            "SELECT count(*) FROM outbox WHERE id = ANY($1) AND status = 'delivered'", ids
        )
        return bool(n == len(ids))
    finally:
        await conn.close()


async def _enqueue(db_url: str, destination: str, evs: list[dict[str, Any]]) -> list[int]:
    conn = await asyncpg.connect(to_asyncpg_dsn(db_url))
    try:
        async with conn.transaction():
            return await outbox.enqueue_many(
                conn,
                [{"destination": destination, **e} for e in evs],  # type: ignore[misc]
            )
    finally:
        await conn.close()


@settings(
    max_examples=6,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(evs=st.lists(event, min_size=1, max_size=25))
def test_keys_headers_payloads_round_trip_through_kafka(
    evs: list[dict[str, Any]], db_url: str, kafka_bootstrap: str
) -> None:
    async def run() -> None:
        topic = f"prop-{uuid.uuid4().hex[:8]}"
        ids = await _enqueue(db_url, "orders", evs)
        async with running(relay_settings(db_url, kafka_bootstrap, topic=topic)):
            # Read once the rows say delivered: a consumer that asks for the topic before the
            # relay's first send created it may not see that send (the test broker).
            await wait_until(lambda: _delivered(db_url, ids), timeout=30, what="delivered")
        records = await consume_ids(kafka_bootstrap, topic, ids, timeout=30)
        got = {outbox_id(r): r for r in records}
        for i, e in zip(ids, evs, strict=True):
            r = got[i]
            assert r.key == (e["key"].encode() if e["key"] is not None else None)
            assert r.value == _stored(e["payload"])
            headers = {k: v.decode() for k, v in r.headers}
            assert {k: headers[k] for k in e["headers"]} == e["headers"]

    asyncio.run(run())


# What an HTTP header carries reliably: visible ASCII and blanks. (A control character fails
# the row with "request not sendable"; non-ASCII goes out as latin-1 or UTF-8 depending on
# the text, httpx's choice, so receivers cannot decode it reliably.) Names are tokens,
# distinct without regard to case (HTTP folds case), not among the relay's own headers.
http_event = st.fixed_dictionaries(
    {
        "key": st.one_of(st.none(), no_nul),
        "headers": st.dictionaries(
            header_names.filter(lambda n: n.lower() not in RESERVED_HEADERS | {"user-agent"}),
            st.text(alphabet=st.characters(min_codepoint=0x20, max_codepoint=0x7E), max_size=30),
            max_size=4,
        ).filter(lambda h: len({n.lower() for n in h}) == len(h)),
        "payload": payloads,
    }
)


@settings(
    max_examples=6,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(evs=st.lists(http_event, min_size=1, max_size=25))
# Found by this test: a value with surrounding blanks failed the row as "not sendable".
@example(evs=[{"key": None, "headers": {"x-note": " padded "}, "payload": {"a": 1}}])
def test_headers_and_payloads_round_trip_through_webhooks(
    evs: list[dict[str, Any]], db_url: str, receiver: Receiver
) -> None:
    async def run() -> None:
        destination = f"hook-{uuid.uuid4().hex[:6]}"
        ids = await _enqueue(db_url, destination, evs)
        hook = {
            "kind": "webhook",
            "url": receiver.url,
            "secrets": [SECRET],
            "allow_private_networks": True,
        }
        s = relay_settings(db_url, "127.0.0.1:9", destinations={destination: hook})
        async with running(s):
            await wait_until(
                lambda: (
                    {r.headers["webhook-id"] for r in receiver.requests} >= {str(i) for i in ids}
                ),
                timeout=30,
                what="every event posted",
            )
        got = {int(r.headers["webhook-id"]): r for r in receiver.requests}
        for i, e in zip(ids, evs, strict=True):
            r = got[i]
            assert r.body == _stored(e["payload"])
            # Every signature, binary bodies included, by the spec; text ones also by the
            # reference library (which takes text only).
            verify_bytes(SECRET, r.body, r.headers)
            with contextlib.suppress(UnicodeDecodeError):
                r.body.decode()
                verify(SECRET, r.body, r.headers)
            for name, value in e["headers"].items():
                # Leading and trailing blanks are not part of an HTTP field value.
                assert r.headers[name.lower()] == value.strip(" \t")

    asyncio.run(run())


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({"OUTBOX_DESTINATIONS": "{not json"}, "in the environment"),
        ({"OUTBOX_RELAY_BACKOFF": "[1,"}, "in the environment"),
        ({"OUTBOX_RELAY_LEASE": "soon"}, "relay.lease"),
    ],
)
def test_bad_environment_values_are_config_errors(
    env: dict[str, str], expected: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Unparsable JSON in an OUTBOX_* variable raised pydantic-settings' SettingsError (a
    traceback and exit status 1) instead of the typed ConfigError (a message and status 2)."""
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ConfigError, match=expected):
        load_settings(None, database_url="postgresql://u@127.0.0.1/db")


def test_private_init_arguments_are_unknown_keys(tmp_path: Path) -> None:
    """A file's top-level `_env_file`/`_secrets_dir` reached pydantic-settings' own init
    arguments: TypeError for a bool, or a file read as dotenv for a path."""
    path = tmp_path / "relay.toml"
    path.write_text('database_url = "postgresql://u@h/db"\n_env_file = "/etc/hostname"\n')
    with pytest.raises(ConfigError, match="_env_file: unknown key"):
        load_settings(path)


# --- whatever enqueue is given: delivered byte for byte, or refused cleanly ------------------

any_char = st.characters(blacklist_categories=())  # every code point: NUL, lone surrogates
any_text = st.one_of(
    st.text(alphabet=any_char, max_size=30),
    st.builds(lambda c, n: c * n, any_char, st.integers(1000, 3000)),  # very long
)
json_values = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(), st.floats(), any_text),
    lambda inner: st.one_of(
        st.lists(inner, max_size=4), st.dictionaries(any_text, inner, max_size=4)
    ),
    max_leaves=12,
)


def _nested(depth: int) -> Any:
    value: Any = 1
    for _ in range(depth):
        value = [value]
    return value


any_event = st.fixed_dictionaries(
    {
        "key": st.one_of(st.none(), any_text),
        "headers": st.one_of(st.none(), st.dictionaries(any_text, any_text, max_size=4)),
        "payload": st.one_of(
            st.binary(max_size=200),
            any_text,
            json_values,
            st.builds(_nested, st.integers(500, 3000)),  # deeper than JSON's parser goes
        ),
        "content_type": st.one_of(st.none(), any_text),
    }
)


async def _try_each(
    db_url: str, evs: list[dict[str, Any]], through: str
) -> list[tuple[int, dict[str, Any]]]:
    """Enqueue each event in a business transaction of its own, on an asyncpg connection or a
    SQLAlchemy AsyncSession; a refusal must be an OutboxValidationError that leaves the
    transaction usable. Returns what was accepted."""
    from sqlalchemy import text
    from sqlalchemy.ext.asyncio import AsyncSession, create_async_engine

    from outbox.dburl import to_sqlalchemy_async_url

    accepted = []
    if through == "asyncpg":
        conn = await asyncpg.connect(to_asyncpg_dsn(db_url))
        try:
            for ev in evs:
                async with conn.transaction():
                    try:
                        row = await outbox.enqueue(conn, destination="orders", **ev)
                    except outbox.OutboxValidationError as exc:
                        assert exc.field in ("key", "headers", "payload", "content_type"), exc
                        assert await conn.fetchval("SELECT 1") == 1  # still usable
                        continue
                    accepted.append((row, ev))
        finally:
            await conn.close()
        return accepted
    engine = create_async_engine(to_sqlalchemy_async_url(db_url))
    try:
        for ev in evs:
            async with AsyncSession(engine) as session, session.begin():
                try:
                    row = await outbox.enqueue(session, destination="orders", **ev)
                except outbox.OutboxValidationError as exc:
                    assert exc.field in ("key", "headers", "payload", "content_type"), exc
                    assert (await session.execute(text("SELECT 1"))).scalar() == 1
                    continue
                accepted.append((row, ev))
    finally:
        await engine.dispose()
    return accepted


def _default_type(ev: dict[str, Any]) -> str:
    payload = ev["payload"]
    if isinstance(payload, bytes):
        return "application/octet-stream"
    if isinstance(payload, str):
        return "text/plain; charset=utf-8"
    return "application/json"


def test_any_event_is_delivered_byte_for_byte_or_refused_cleanly(
    db_url: str, kafka_bootstrap: str, long_run: bool
) -> None:
    @settings(
        max_examples=60 if long_run else 12,
        deadline=None,
        suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
    )
    @given(
        evs=st.lists(any_event, min_size=1, max_size=12),
        through=st.sampled_from(["asyncpg", "sqlalchemy"]),
    )
    def check(evs: list[dict[str, Any]], through: str) -> None:
        asyncio.run(run(evs, through))

    async def run(evs: list[dict[str, Any]], through: str) -> None:
        accepted = await _try_each(db_url, evs, through)
        if not accepted:
            return
        ids = [row for row, _ in accepted]
        topic = f"any-{uuid.uuid4().hex[:8]}"
        async with running(relay_settings(db_url, kafka_bootstrap, topic=topic)):
            await wait_until(lambda: _delivered(db_url, ids), timeout=30, what="delivered")
        got = {outbox_id(r): r for r in await consume_ids(kafka_bootstrap, topic, ids)}
        for row, ev in accepted:
            r = got[row]
            assert r.key == (ev["key"].encode() if ev["key"] is not None else None)
            assert r.value == _stored(ev["payload"])
            headers = {k: v.decode() for k, v in r.headers}
            for name, value in (ev["headers"] or {}).items():
                if name not in ("outbox-id", "content-type"):
                    assert headers[name] == value
            assert headers["content-type"] == (ev["content_type"] or _default_type(ev))

    check()
