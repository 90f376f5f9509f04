"""The webhook sink's own HTTP/1.1 client (relay/sinks/webhook/http1.py) against real
sockets on loopback: servers that answer as real ones do, badly ones included. The tests
after "A hostile review" each failed on 5aace85."""

from __future__ import annotations

import asyncio
import contextlib
import ssl
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field

import pytest
from yarl import URL

from outbox.webhooks.ssrf import AddressPolicy
from relay.breaker import State
from relay.model import Result
from relay.sinks.webhook.config import WebhookClientSettings
from relay.sinks.webhook.http1 import (
    BadAnswer,
    ConnectFailed,
    Disconnected,
    Pool,
    host_header,
)
from relay.sinks.webhook.requests import RequestPath
from tests.webhook_helpers import closed_port, dest, envelope

LOOPBACK = AddressPolicy(True, ())
OK = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok"

# What a server does with one request: the request's head, the connection's writer, and
# the number of the request on its connection (1, 2, ...).
Handler = Callable[[bytes, asyncio.StreamWriter, int], Awaitable[None]]


@dataclass
class Server:
    port: int
    connections: int = 0
    requests: list[bytes] = field(default_factory=list)
    open_now: int = 0
    most_open: int = 0
    closed_by_peer: int = 0

    @property
    def url(self) -> URL:
        return URL(f"http://127.0.0.1:{self.port}/hook")


@pytest.fixture
async def serve() -> AsyncIterator[Callable[[Handler], Awaitable[Server]]]:
    servers: list[asyncio.Server] = []

    async def start(handler: Handler) -> Server:
        state = Server(0)

        async def on_connect(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            state.connections += 1
            state.open_now += 1
            state.most_open = max(state.most_open, state.open_now)
            n = 0
            try:
                while True:
                    head = await reader.readuntil(b"\r\n\r\n")
                    length = 0
                    for line in head.split(b"\r\n"):
                        if line.lower().startswith(b"content-length:"):
                            length = int(line.split(b":")[1])
                    await reader.readexactly(length)
                    n += 1
                    state.requests.append(head)
                    await handler(head, writer, n)
                    if writer.is_closing():
                        return
            except (asyncio.IncompleteReadError, ConnectionError):
                state.closed_by_peer += 1
            finally:
                state.open_now -= 1
                writer.close()

        server = await asyncio.start_server(on_connect, "127.0.0.1", 0)
        servers.append(server)
        state.port = server.sockets[0].getsockname()[1]
        return state

    yield start
    for server in servers:
        server.close()


@pytest.fixture
async def new_pool() -> AsyncIterator[Callable[..., Pool]]:
    """Pools of the loopback policy, closed at the test's end."""
    made: list[Pool] = []

    def make(limit: int = 4, keepalive: float = 30.0) -> Pool:
        made.append(
            Pool(
                LOOPBACK, limit=limit, keepalive=keepalive, ssl_context=ssl.create_default_context()
            )
        )
        return made[-1]

    yield make
    for p in made:
        await p.close()


@pytest.fixture
def pool(new_pool: Callable[..., Pool]) -> Pool:
    return new_pool(limit=10)


def request(url: URL, body: bytes = b"{}") -> list[bytes]:
    head = f"POST {url.raw_path_qs} HTTP/1.1\r\nhost: {host_header(url)}\r\n"
    return [head.encode(), f"content-length: {len(body)}\r\n\r\n".encode(), body]


async def answer_ok(head: bytes, w: asyncio.StreamWriter, n: int) -> None:
    w.write(OK)


async def test_a_keep_alive_connection_serves_the_next_request(
    serve: Callable[[Handler], Awaitable[Server]], pool: Pool
) -> None:
    server = await serve(answer_ok)
    for _ in range(3):
        got = await pool.request(server.url, request(server.url), 1024, 5.0)
        assert (got.status, got.body) == (200, b"ok")
    assert server.connections == 1 and len(server.requests) == 3
    assert server.requests[0].startswith(b"POST /hook HTTP/1.1\r\nhost: 127.0.0.1:")


async def test_a_reused_connection_the_server_drops_unanswered_is_not_sent_again(
    serve: Callable[[Handler], Awaitable[Server]], pool: Pool
) -> None:
    """A receiver closing a keep-alive connection as a request goes out on it: the attempt
    fails (a retry, counted and logged), the request is not sent again unseen. Sent again at
    once, the receiver got it twice in one attempt (the fault suite's "every copy an attempt
    logged" found it in 5aace85)."""

    async def drop_the_second(head: bytes, w: asyncio.StreamWriter, n: int) -> None:
        if n == 2:
            w.close()
        else:
            w.write(OK)

    server = await serve(drop_the_second)
    assert (await pool.request(server.url, request(server.url), 1024, 5.0)).status == 200
    with pytest.raises(Disconnected, match="without answering"):
        await pool.request(server.url, request(server.url), 1024, 5.0)
    assert server.connections == 1 and len(server.requests) == 2
    # The next request opens a new connection.
    assert (await pool.request(server.url, request(server.url), 1024, 5.0)).status == 200
    assert server.connections == 2


async def test_a_new_connection_dropped_unanswered_is_not_tried_again(
    serve: Callable[[Handler], Awaitable[Server]], pool: Pool
) -> None:
    async def drop(head: bytes, w: asyncio.StreamWriter, n: int) -> None:
        w.close()

    server = await serve(drop)
    with pytest.raises(Disconnected, match="without answering"):
        await pool.request(server.url, request(server.url), 1024, 5.0)
    assert len(server.requests) == 1


async def test_an_answer_cut_short_is_an_error_and_is_not_sent_again(
    serve: Callable[[Handler], Awaitable[Server]], pool: Pool
) -> None:
    async def half(head: bytes, w: asyncio.StreamWriter, n: int) -> None:
        if n == 1:
            w.write(OK)
        else:
            w.write(b"HTTP/1.1 200 OK\r\ncontent-length: 10\r\n\r\nok")
            w.close()

    server = await serve(half)
    await pool.request(server.url, request(server.url), 1024, 5.0)
    with pytest.raises(Disconnected, match="middle of its answer"):
        await pool.request(server.url, request(server.url), 1024, 5.0)
    assert len(server.requests) == 2


async def test_connection_close_is_honoured(
    serve: Callable[[Handler], Awaitable[Server]], pool: Pool
) -> None:
    async def closing(head: bytes, w: asyncio.StreamWriter, n: int) -> None:
        w.write(b"HTTP/1.1 204 No Content\r\nconnection: close\r\n\r\n")

    server = await serve(closing)
    for _ in range(2):
        assert (await pool.request(server.url, request(server.url), 1024, 5.0)).status == 204
    assert server.connections == 2


async def test_an_answer_ended_by_the_close_of_the_connection_is_read_whole(
    serve: Callable[[Handler], Awaitable[Server]], pool: Pool
) -> None:
    async def http10(head: bytes, w: asyncio.StreamWriter, n: int) -> None:
        w.write(b"HTTP/1.0 500 Oops\r\n\r\nsomething broke")
        await w.drain()
        w.close()

    server = await serve(http10)
    got = await pool.request(server.url, request(server.url), 1024, 5.0)
    assert (got.status, got.body) == (500, b"something broke")


async def test_chunks_and_interim_answers_are_read_and_the_body_capped(
    serve: Callable[[Handler], Awaitable[Server]], pool: Pool
) -> None:
    async def chunked(head: bytes, w: asyncio.StreamWriter, n: int) -> None:
        w.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        w.write(
            b"HTTP/1.1 400 Bad\r\ntransfer-encoding: chunked\r\nRetry-After: 7\r\n\r\n"
            b"5\r\nhello\r\n6\r\n world\r\n0\r\n\r\n"
        )

    server = await serve(chunked)
    got = await pool.request(server.url, request(server.url), 1024, 5.0)
    assert (got.status, got.body, got.headers["retry-after"]) == (400, b"hello world", "7")
    capped = await pool.request(server.url, request(server.url), 7, 5.0)
    assert capped.body == b"hello w"
    # The rest of a capped answer is not read: that connection is not used again.
    await pool.request(server.url, request(server.url), 1024, 5.0)
    assert server.connections == 2


async def test_an_oversized_head_and_a_non_http_answer_are_errors(
    serve: Callable[[Handler], Awaitable[Server]], pool: Pool
) -> None:
    async def huge(head: bytes, w: asyncio.StreamWriter, n: int) -> None:
        w.write(b"HTTP/1.1 200 OK\r\n")
        for i in range(5000):
            w.write(f"x-filler-{i}: {'a' * 40}\r\n".encode())
            if i % 100 == 0:
                await w.drain()
                await asyncio.sleep(0)

    async def junk(head: bytes, w: asyncio.StreamWriter, n: int) -> None:
        w.write(b"SSH-2.0-OpenSSH_9.6\r\n\r\n")

    server = await serve(huge)
    with pytest.raises(BadAnswer, match="head is over 65536 bytes"):
        async with asyncio.timeout(10):  # without the bound, the read would go on
            await pool.request(server.url, request(server.url), 1024, 5.0)
    server = await serve(junk)
    with pytest.raises(BadAnswer, match=r"not an HTTP/1\.1 answer"):
        await pool.request(server.url, request(server.url), 1024, 5.0)


async def test_no_more_than_the_limit_of_connections_are_in_use(
    serve: Callable[[Handler], Awaitable[Server]],
    new_pool: Callable[..., Pool],
) -> None:
    async def slow(head: bytes, w: asyncio.StreamWriter, n: int) -> None:
        await asyncio.sleep(0.05)
        w.write(OK)

    server = await serve(slow)
    p = new_pool(limit=2)
    got = await asyncio.gather(
        *(p.request(server.url, request(server.url), 1024, 5.0) for _ in range(8))
    )
    assert [g.status for g in got] == [200] * 8
    assert server.most_open == 2 and server.connections == 2


async def test_a_cancelled_request_closes_its_connection_and_frees_its_slot(
    serve: Callable[[Handler], Awaitable[Server]],
    new_pool: Callable[..., Pool],
) -> None:
    async def first_hangs(head: bytes, w: asyncio.StreamWriter, n: int) -> None:
        if b"x-hang" in head:
            await asyncio.sleep(30)
        w.write(OK)

    server = await serve(first_hangs)
    p = new_pool(limit=1)
    hang = request(server.url)
    hang[1] = b"x-hang: 1\r\n" + hang[1]
    with pytest.raises(TimeoutError):
        async with asyncio.timeout(0.2):
            await p.request(server.url, hang, 1024, 5.0)
    got = await asyncio.wait_for(p.request(server.url, request(server.url), 1024, 5.0), 5)
    assert got.status == 200 and server.connections == 2


async def test_idle_connections_are_closed_after_the_keepalive(
    serve: Callable[[Handler], Awaitable[Server]],
    new_pool: Callable[..., Pool],
) -> None:
    server = await serve(answer_ok)
    p = new_pool(limit=4, keepalive=0.2)
    await p.request(server.url, request(server.url), 1024, 5.0)
    assert server.open_now == 1
    for _ in range(50):
        await asyncio.sleep(0.05)
        if server.open_now == 0:
            break
    assert server.open_now == 0
    await p.request(server.url, request(server.url), 1024, 5.0)
    assert server.connections == 2


async def test_a_refused_connection_names_the_error(pool: Pool) -> None:
    url = URL(f"http://127.0.0.1:{closed_port()}/")
    with pytest.raises(ConnectFailed, match=r"cannot connect \(ConnectionRefusedError\)"):
        await pool.request(url, request(url), 1024, 5.0)


def test_the_host_header_leaves_out_the_default_port() -> None:
    assert host_header(URL("https://example.com/x")) == "example.com"
    assert host_header(URL("http://example.com:8080/x")) == "example.com:8080"
    assert host_header(URL("http://[::1]:8080/x")) == "[::1]:8080"


# A hostile review of 5aace85 (the first version of the client)

Serve = Callable[[Handler], Awaitable[Server]]


# 1. Header injection / request smuggling through a row's content_type -------------------


async def test_a_row_content_type_with_a_line_break_is_not_sent_as_headers(serve: Serve) -> None:
    """enqueue() refuses control characters in content_type, but rows written with plain SQL
    can hold anything (docs/guarantees.md); aiohttp refused such a header. Sent raw, it
    lets a row add any header: here a transfer-encoding beside the content-length
    (a request-smuggling set-up at the receiver's proxy)."""
    server = await serve(answer_ok)
    path = RequestPath(WebhookClientSettings())
    await path.start()
    try:
        d = dest(str(server.url))
        t = path.target("hook", d, d.url, d.signing_keys())
        env = envelope(
            content_type="application/json\r\ntransfer-encoding: chunked\r\nx-smuggled: 1"
        )
        answer = await path.send(t, env)
    finally:
        await path.close()
    sent = b"".join(server.requests)
    assert b"\r\nx-smuggled: 1\r\n" not in sent and b"\r\ntransfer-encoding:" not in sent
    assert answer.outcome.result is Result.FAILED, answer.outcome


def test_a_user_agent_with_a_line_break_is_refused_at_load() -> None:
    """It is written into every request as it is (aiohttp refused it at the request)."""
    with pytest.raises(ValueError, match="line break"):
        WebhookClientSettings(user_agent="relay\r\nx-smuggled: 1")


# 2. Pool.close() with requests under way: sent again after close, sockets leaked ---------


async def test_a_closed_pool_sends_nothing_more_and_leaves_no_connection_open(
    serve: Serve,
    new_pool: Callable[..., Pool],
) -> None:
    async def second_is_slow(head: bytes, w: asyncio.StreamWriter, n: int) -> None:
        if n == 2:
            await asyncio.sleep(0.3)
        w.write(OK)

    server = await serve(second_is_slow)
    p = new_pool(limit=4)
    await p.request(server.url, request(server.url), 1024, 5.0)  # one idle connection
    inflight = asyncio.create_task(p.request(server.url, request(server.url), 1024, 5.0))
    await asyncio.sleep(0.1)  # request 2 is out on the reused connection
    await p.close()  # the sink stops
    with contextlib.suppress(Exception):
        await asyncio.wait_for(inflight, 5)
    await asyncio.sleep(0.3)
    # Nothing goes out after close(), and close() leaves no socket open.
    assert len(server.requests) == 2, f"{len(server.requests)} requests, {server.connections} conns"
    assert server.open_now == 0, f"{server.open_now} connection(s) left open after close()"


async def test_a_request_waiting_for_a_slot_at_close_leaves_no_connection_open(
    serve: Serve,
    new_pool: Callable[..., Pool],
) -> None:
    async def slow(head: bytes, w: asyncio.StreamWriter, n: int) -> None:
        await asyncio.sleep(0.2)
        w.write(OK)

    server = await serve(slow)
    p = new_pool(limit=1)
    first = asyncio.create_task(p.request(server.url, request(server.url), 1024, 5.0))
    waiting = asyncio.create_task(p.request(server.url, request(server.url), 1024, 5.0))
    await asyncio.sleep(0.05)
    await p.close()
    await asyncio.gather(first, waiting, return_exceptions=True)
    await asyncio.sleep(0.3)
    assert server.open_now == 0, f"{server.open_now} connection(s) left open after close()"


# 3. Bytes after an answer in the same read: the connection is reused mid-message -----------


async def test_bytes_after_an_answer_do_not_spoil_the_next_request(
    serve: Serve, new_pool: Callable[..., Pool]
) -> None:
    """Unsolicited bytes make a connection's state unknown (Connection.data_received): only
    when they come in a read of their own. In the same read as the answer they are parsed
    as the start of another answer and the connection goes back to the pool: the next
    request's answer, which the receiver did send, is then unreadable."""

    async def extra(head: bytes, w: asyncio.StreamWriter, n: int) -> None:
        w.write(OK + (b"HTTP/1.1 200 OK\r\n" if n == 1 else b""))

    server = await serve(extra)
    p = new_pool(limit=4)
    assert (await p.request(server.url, request(server.url), 1024, 5.0)).status == 200
    got = await p.request(server.url, request(server.url), 1024, 5.0)
    assert got.status == 200


async def test_an_answer_s_headers_are_not_changed_by_later_bytes(
    serve: Serve, new_pool: Callable[..., Pool]
) -> None:
    async def twice(head: bytes, w: asyncio.StreamWriter, n: int) -> None:
        w.write(
            b"HTTP/1.1 503 Busy\r\ncontent-length: 0\r\n\r\n"
            b"HTTP/1.1 200 OK\r\nretry-after: 86400\r\ncontent-length: 0\r\n\r\n"
        )

    server = await serve(twice)
    p = new_pool(limit=4)
    got = await p.request(server.url, request(server.url), 1024, 5.0)
    assert got.status == 503
    assert "retry-after" not in got.headers, got.headers


# 4. Trailers are not bounded by MAX_HEAD (memory held by a hostile receiver) -------------


async def test_trailers_are_not_kept(serve: Serve, new_pool: Callable[..., Pool]) -> None:
    """A chunked answer's trailers go into the same headers dict, with no bound: a receiver
    (an endpoint a tenant registered) can make the relay hold as much as it sends within the
    attempt's timeout. 100,000 trailers (1.5 MB) were kept by 5aace85."""

    async def trailers(head: bytes, w: asyncio.StreamWriter, n: int) -> None:
        w.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n0\r\n")
        for i in range(100):
            w.write(b"".join(b"x-%d: v\r\n" % (i * 1000 + j) for j in range(1000)))
            await w.drain()
        w.write(b"\r\n")

    server = await serve(trailers)
    p = new_pool(limit=4)
    got = await p.request(server.url, request(server.url), 1024, 5.0)
    # The answer is read, its trailers not kept (nor let to change its headers).
    assert got.status == 200 and got.headers == {"transfer-encoding": "chunked"}, got.headers


async def test_a_request_the_closing_client_never_sent_is_put_back_unattempted(
    serve: Serve,
) -> None:
    """The sink stops with a request waiting for a connection slot: nothing went out, so the
    row is deferred (not attempted), as a send after the close is, not a failed attempt
    counted against the endpoint's circuit."""

    async def slow(head: bytes, w: asyncio.StreamWriter, n: int) -> None:
        await asyncio.sleep(0.3)
        w.write(OK)

    server = await serve(slow)
    path = RequestPath(WebhookClientSettings(max_connections=1))
    await path.start()
    d = dest(str(server.url))
    t = path.target("hook", d, d.url, d.signing_keys())
    first = asyncio.create_task(path.send(t, envelope()))
    await asyncio.sleep(0.05)
    second = asyncio.create_task(path.send(t, envelope()))
    await asyncio.sleep(0.05)
    await path.close()
    answer = await asyncio.wait_for(second, 5)
    await asyncio.gather(first, return_exceptions=True)
    assert answer.outcome.result is Result.DEFER, answer.outcome
    assert "closed" in (answer.outcome.error or "")
    assert len(server.requests) == 1 and t.breaker.state is State.CLOSED


async def test_a_content_type_is_checked_for_every_row_not_only_the_first(
    serve: Serve,
) -> None:
    """Sendable content types are remembered; one that is not never is, nor does a good one
    let a bad one through."""
    server = await serve(answer_ok)
    path = RequestPath(WebhookClientSettings())
    await path.start()
    try:
        d = dest(str(server.url))
        t = path.target("hook", d, d.url, d.signing_keys())
        bad = "text/plain\r\nx-smuggled: 1"
        for ct in ("application/json", bad, "application/json", bad):
            answer = await path.send(t, envelope(content_type=ct))
            expected = Result.FAILED if ct == bad else Result.DELIVERED
            assert answer.outcome.result is expected, (ct, answer.outcome)
    finally:
        await path.close()
    assert len(server.requests) == 2


async def test_a_request_out_on_a_reused_connection_as_the_client_closes_is_an_attempt(
    serve: Serve,
) -> None:
    """The receiver has the request when the sink stops: its connection closed by the
    client's close(), it is not tried again, nor taken for one never sent (found by review:
    deferred as "not sent" when its connection was a reused one)."""

    async def second_hangs(head: bytes, w: asyncio.StreamWriter, n: int) -> None:
        if n == 2:
            await asyncio.sleep(1.0)
        w.write(OK)

    server = await serve(second_hangs)
    path = RequestPath(WebhookClientSettings())
    await path.start()
    d = dest(str(server.url))
    t = path.target("hook", d, d.url, d.signing_keys())
    assert (await path.send(t, envelope())).outcome.result is Result.DELIVERED
    second = asyncio.create_task(path.send(t, envelope()))
    await asyncio.sleep(0.1)
    assert len(server.requests) == 2  # the receiver has request 2
    await path.close()
    answer = await asyncio.wait_for(second, 5)
    assert answer.outcome.result is Result.RETRY, answer.outcome
    assert len(server.requests) == 2  # not sent again
