"""The webhook sink's HTTP client keeps every guarantee the sink makes: the SSRF
guard on resolved names (DNS answers faked, connections real), no cookies or proxies from
anywhere, each row's destination respected, and the claim woken when a full sink drains."""

from __future__ import annotations

import asyncio
import ipaddress
import ssl
import subprocess
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest

from outbox.webhooks.ssrf import IPAddress
from relay.model import Result
from relay.sinks.webhook import http1 as client_module
from relay.sinks.webhook.config import WebhookClientSettings
from relay.sinks.webhook.sink import WebhookSink
from tests.support.receiver import Receiver
from tests.webhook_helpers import closed_port, dest, envelope


@pytest.fixture
async def sinks() -> AsyncIterator[list[WebhookSink]]:
    made: list[WebhookSink] = []
    yield made
    for s in made:
        await s.close()


@pytest.fixture
def fake_dns(monkeypatch: pytest.MonkeyPatch) -> Callable[[str, list[str]], None]:
    """Make the guard's resolver answer ``host`` with ``addresses`` (other names resolve)."""
    answers: dict[str, list[IPAddress]] = {}
    real = client_module.resolve

    async def resolve(host: str, port: int) -> list[IPAddress]:
        if host in answers:
            return answers[host]
        return await real(host, port)

    monkeypatch.setattr(client_module, "resolve", resolve)

    def set_answer(host: str, addresses: list[str]) -> None:
        answers[host] = [ipaddress.ip_address(a) for a in addresses]

    return set_answer


@pytest.mark.parametrize(
    "answer",
    [["127.0.0.1"], ["::ffff:127.0.0.1"], ["8.8.8.8", "127.0.0.1"], ["::ffff:169.254.169.254"]],
    ids=["loopback", "ipv4-mapped-ipv6", "public-and-private-mix", "mapped-metadata"],
)
async def test_a_name_resolving_to_a_private_address_is_refused(
    answer: list[str],
    fake_dns: Callable[[str, list[str]], None],
    receiver: Receiver,
    sinks: list[WebhookSink],
) -> None:
    fake_dns("hooks.example.test", answer)
    url = f"http://hooks.example.test:{receiver.port}/in"
    sink = WebhookSink(WebhookClientSettings(), {"hook": dest(url, allow_private_networks=False)})
    sinks.append(sink)
    [outcome] = await sink.deliver([envelope()])
    assert outcome.result is Result.FAILED, outcome
    error = outcome.error or ""
    assert "refused by the SSRF guard" in error and "allow_private_networks" in error
    assert ipaddress.ip_address(answer[-1]).compressed in error or answer[-1] in error
    assert receiver.requests == []


async def test_the_connection_goes_to_the_checked_address(
    fake_dns: Callable[[str, list[str]], None], receiver: Receiver, sinks: list[WebhookSink]
) -> None:
    """Allowed by an allow-list naming the IPv4 network, a name answered with the IPv4-mapped
    IPv6 form of loopback is reached at exactly that address (no second lookup)."""
    fake_dns("hooks.example.test", ["::ffff:127.0.0.1"])
    url = f"http://hooks.example.test:{receiver.port}/in"
    hook = dest(url, allow_private_networks=False, allowed_networks=["127.0.0.0/8"])
    sink = WebhookSink(WebhookClientSettings(), {"hook": hook})
    sinks.append(sink)
    [outcome] = await sink.deliver([envelope()])
    assert outcome.result is Result.DELIVERED, outcome
    [request] = receiver.wait_for(1)
    assert request.headers["host"] == f"hooks.example.test:{receiver.port}"


async def test_no_cookie_travels_from_one_answer_to_the_next_request(
    fake_dns: Callable[[str, list[str]], None], receiver: Receiver, sinks: list[WebhookSink]
) -> None:
    # A host name: a cookie jar would refuse cookies of a bare IP address anyway.
    fake_dns("hooks.example.test", ["127.0.0.1"])
    receiver.respond(200, headers={"Set-Cookie": "session=abc; Path=/"}, times=1)
    url = f"http://hooks.example.test:{receiver.port}/in"
    sink = WebhookSink(WebhookClientSettings(), {"hook": dest(url)})
    sinks.append(sink)
    for _ in range(2):
        [outcome] = await sink.deliver([envelope()])
        assert outcome.result is Result.DELIVERED
    _, second = receiver.wait_for(2)
    assert "cookie" not in {k.lower() for k in second.headers}


async def test_proxy_variables_are_ignored(
    monkeypatch: pytest.MonkeyPatch, receiver: Receiver, sinks: list[WebhookSink]
) -> None:
    dead_proxy = f"http://127.0.0.1:{closed_port()}"
    for var in ("HTTP_PROXY", "http_proxy", "HTTPS_PROXY", "ALL_PROXY"):
        monkeypatch.setenv(var, dead_proxy)
    monkeypatch.delenv("NO_PROXY", raising=False)
    monkeypatch.delenv("no_proxy", raising=False)
    sink = WebhookSink(WebhookClientSettings(), {"hook": dest(receiver.url)})
    sinks.append(sink)
    [outcome] = await sink.deliver([envelope()])
    assert outcome.result is Result.DELIVERED, outcome
    assert len(receiver.wait_for(1)) == 1


async def test_a_large_answer_is_read_only_up_to_the_cap(sinks: list[WebhookSink]) -> None:
    """64 bytes of a 2 MB answer are read; the rest is not drained: that connection is
    closed, and the next request opens a new one."""
    big = b"HTTP/1.1 500 Oops\r\ncontent-length: 2000000\r\n\r\n" + b"E" * 2_000_000
    answers = iter([big, OK])
    connections: list[int] = []
    server, port = await _raw_server(lambda: next(answers), connections=connections)
    sink = WebhookSink(
        WebhookClientSettings(max_response_bytes=64), {"hook": dest(f"http://127.0.0.1:{port}/")}
    )
    sinks.append(sink)
    try:
        [first] = await sink.deliver([envelope()])
        [second] = await sink.deliver([envelope()])
    finally:
        server.close()
    assert first.result is Result.RETRY
    assert "E" * 64 in (first.error or "") and "E" * 65 not in (first.error or "")
    assert second.result is Result.DELIVERED, second
    assert len(connections) == 2  # not reused after a partial read


async def test_rows_of_another_destination_fail_alone(
    receiver: Receiver, sinks: list[WebhookSink]
) -> None:
    sink = WebhookSink(WebhookClientSettings(), {"hook": dest(receiver.url)})
    sinks.append(sink)
    ours, stray = envelope("hook"), envelope("elsewhere")
    outcomes = {o.id: o for o in await sink.deliver([ours, stray])}
    assert outcomes[ours.id].result is Result.DELIVERED
    assert outcomes[stray.id].result is Result.FAILED
    assert "'elsewhere' is not a webhook one" in (outcomes[stray.id].error or "")
    [only_stray] = await sink.deliver([envelope("elsewhere")])
    assert only_stray.result is Result.FAILED


async def test_a_batch_larger_than_the_concurrency_is_sent_in_full(
    receiver: Receiver, sinks: list[WebhookSink]
) -> None:
    """Workers walk the batch: every row is sent once, in a batch ten times the limit."""
    sink = WebhookSink(WebhookClientSettings(), {"hook": dest(receiver.url, max_concurrency=3)})
    sinks.append(sink)
    batch = [envelope() for _ in range(30)]
    outcomes = await sink.deliver(batch)
    assert [o.id for o in outcomes] == [e.id for e in batch]
    assert all(o.result is Result.DELIVERED for o in outcomes)
    ids = sorted(int(r.headers["webhook-id"]) for r in receiver.wait_for(30))
    assert ids == sorted(e.id for e in batch)


async def test_concurrent_batches_share_the_endpoint_limit(
    receiver: Receiver, sinks: list[WebhookSink]
) -> None:
    receiver.respond(200, delay=0.2)
    sink = WebhookSink(WebhookClientSettings(), {"hook": dest(receiver.url, max_concurrency=2)})
    sinks.append(sink)
    results = await asyncio.gather(*(sink.deliver([envelope(), envelope()]) for _ in range(3)))
    assert all(o.result is Result.DELIVERED for r in results for o in r)
    assert receiver.max_in_flight == 2


# --- found by a hostile review of the new client ---------------------------------------------


async def _raw_server(
    answer: bytes | Callable[[], bytes],
    seen: list[bytes] | None = None,
    ssl_ctx: ssl.SSLContext | None = None,
    connections: list[int] | None = None,
) -> tuple[asyncio.Server, int]:
    """A bare HTTP/1.1 server answering every request with ``answer`` (or what it returns);
    notes request lines and accepted connections."""

    async def handle(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        if connections is not None:
            connections.append(w.get_extra_info("peername")[1])
        try:
            while True:
                head = []
                while (line := await r.readline()) not in (b"\r\n", b""):
                    head.append(line)
                if not head:
                    return
                if seen is not None:
                    seen.append(head[0])
                length = next(
                    (
                        int(h.split(b":")[1])
                        for h in head
                        if h.lower().startswith(b"content-length")
                    ),
                    0,
                )
                await r.readexactly(length)
                w.write(answer() if callable(answer) else answer)
                await w.drain()
        except (OSError, asyncio.IncompleteReadError, ssl.SSLError):
            pass
        finally:
            w.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0, ssl=ssl_ctx)
    return server, server.sockets[0].getsockname()[1]


OK = b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n"
TRIP = {"threshold": 1, "cooldown": 30, "max_cooldown": 60}


async def test_an_untrusted_certificate_is_a_retry_and_counts_the_endpoint_down(
    tmp_path: Path, sinks: list[WebhookSink]
) -> None:
    """TLS is verified; a self-signed (expired, mis-issued) certificate gets fixed, so the row
    is retried and the circuit counts it, not failed for good as "not sendable"."""
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key),
         "-out", str(cert), "-days", "1", "-subj", "/CN=127.0.0.1",
         "-addext", "subjectAltName=IP:127.0.0.1"],
        check=True,
        capture_output=True,
    )  # fmt: skip
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.load_cert_chain(cert, key)
    server, port = await _raw_server(OK, ssl_ctx=ctx)
    sink = WebhookSink(
        WebhookClientSettings(), {"hook": dest(f"https://127.0.0.1:{port}/", circuit=TRIP)}
    )
    sinks.append(sink)
    try:
        [outcome] = await sink.deliver([envelope()])
    finally:
        server.close()
    assert outcome.result is Result.RETRY, outcome
    assert "TLS certificate not trusted" in (outcome.error or ""), outcome
    assert not sink.available("hook")  # the circuit opened


async def test_an_overflowing_retry_after_date_is_still_a_503(sinks: list[WebhookSink]) -> None:
    answer = (
        b"HTTP/1.1 503 Busy\r\nretry-after: Mon, 01 Jan 2030 00:00:00 +99999999999999\r\n"
        b"content-length: 0\r\n\r\n"
    )
    server, port = await _raw_server(answer)
    sink = WebhookSink(
        WebhookClientSettings(), {"hook": dest(f"http://127.0.0.1:{port}/", circuit=TRIP)}
    )
    sinks.append(sink)
    try:
        [outcome] = await sink.deliver([envelope()])
    finally:
        server.close()
    assert outcome.result is Result.RETRY and (outcome.error or "").startswith("HTTP 503"), outcome
    assert not sink.available("hook")  # the 503 counted against the endpoint


@pytest.mark.parametrize(
    ("target", "sent"),
    [
        ("/in?token=ab%2Bc%2Fd%3D&x=%41", "/in?token=ab%2Bc%2Fd%3D&x=%41"),
        ("/%41%7E/a%2fb", "/%41%7E/a%2fb"),
        ("/a b/ü?q=a b", "/a%20b/%C3%BC?q=a%20b"),  # only what a request line cannot hold
    ],
)
async def test_the_configured_request_target_is_sent_as_written(
    target: str, sent: str, sinks: list[WebhookSink]
) -> None:
    """Receivers that sign or compare the raw URL must see it as configured."""
    seen: list[bytes] = []
    server, port = await _raw_server(OK, seen=seen)
    sink = WebhookSink(WebhookClientSettings(), {"hook": dest(f"http://127.0.0.1:{port}{target}")})
    sinks.append(sink)
    try:
        [outcome] = await sink.deliver([envelope()])
    finally:
        server.close()
    assert outcome.result is Result.DELIVERED, outcome
    assert seen[0].split(b" ")[1] == sent.encode()


@pytest.mark.parametrize("url", ["http://example.com/a\r\nX-Evil: 1", "http://example.com/a\tb"])
def test_a_url_with_a_control_character_is_refused(url: str) -> None:
    with pytest.raises(ValueError, match="control character"):
        dest(url)


@pytest.mark.parametrize("value", ["Bearer abc\x0b", "a\x1bb", "x\x7f"])
def test_a_configured_header_with_a_control_character_is_refused(value: str) -> None:
    with pytest.raises(ValueError, match="control character"):
        dest("https://example.com/", headers={"Authorization": value})


async def test_a_row_header_that_cannot_be_encoded_fails_alone(
    receiver: Receiver, sinks: list[WebhookSink]
) -> None:
    sink = WebhookSink(WebhookClientSettings(), {"hook": dest(receiver.url)})
    sinks.append(sink)
    bad, good = envelope(headers={"x-note": "\udcff"}), envelope()
    outcomes = {o.id: o for o in await sink.deliver([bad, good])}
    assert outcomes[bad.id].result is Result.FAILED
    assert "cannot be encoded" in (outcomes[bad.id].error or "")
    assert outcomes[good.id].result is Result.DELIVERED
