"""The webhook sink's own HTTP/1.1 client (relay/sinks/webhook/http1.py) against real
sockets on loopback: servers that answer as real ones do, badly ones included."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field

import pytest
from yarl import URL

from outbox.webhooks.ssrf import AddressPolicy
from relay.sinks.webhook.http1 import (
    BadAnswer,
    ConnectFailed,
    Disconnected,
    Pool,
    host_header,
)
from tests.webhook_helpers import closed_port

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
async def pool() -> AsyncIterator[Pool]:
    import ssl

    p = Pool(LOOPBACK, limit=10, keepalive=30.0, ssl_context=ssl.create_default_context())
    yield p
    await p.close()


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


async def test_a_connection_the_server_drops_unanswered_is_tried_again_on_a_new_one(
    serve: Callable[[Handler], Awaitable[Server]], pool: Pool
) -> None:
    """A receiver closing an idle keep-alive connection just as a request goes out on it is
    no failed attempt: the request goes out again on a new connection, once."""

    async def drop_the_second(head: bytes, w: asyncio.StreamWriter, n: int) -> None:
        if n == 2:
            w.close()
        else:
            w.write(OK)

    server = await serve(drop_the_second)
    for _ in range(2):
        got = await pool.request(server.url, request(server.url), 1024, 5.0)
        assert got.status == 200
    assert server.connections == 2 and len(server.requests) == 3


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
) -> None:
    import ssl

    async def slow(head: bytes, w: asyncio.StreamWriter, n: int) -> None:
        await asyncio.sleep(0.05)
        w.write(OK)

    server = await serve(slow)
    p = Pool(LOOPBACK, limit=2, keepalive=30.0, ssl_context=ssl.create_default_context())
    try:
        got = await asyncio.gather(
            *(p.request(server.url, request(server.url), 1024, 5.0) for _ in range(8))
        )
        assert [g.status for g in got] == [200] * 8
        assert server.most_open == 2 and server.connections == 2
    finally:
        await p.close()


async def test_a_cancelled_request_closes_its_connection_and_frees_its_slot(
    serve: Callable[[Handler], Awaitable[Server]],
) -> None:
    import ssl

    async def first_hangs(head: bytes, w: asyncio.StreamWriter, n: int) -> None:
        if b"x-hang" in head:
            await asyncio.sleep(30)
        w.write(OK)

    server = await serve(first_hangs)
    p = Pool(LOOPBACK, limit=1, keepalive=30.0, ssl_context=ssl.create_default_context())
    try:
        hang = request(server.url)
        hang[1] = b"x-hang: 1\r\n" + hang[1]
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(0.2):
                await p.request(server.url, hang, 1024, 5.0)
        got = await asyncio.wait_for(p.request(server.url, request(server.url), 1024, 5.0), 5)
        assert got.status == 200 and server.connections == 2
    finally:
        await p.close()


async def test_idle_connections_are_closed_after_the_keepalive(
    serve: Callable[[Handler], Awaitable[Server]],
) -> None:
    import ssl

    server = await serve(answer_ok)
    p = Pool(LOOPBACK, limit=4, keepalive=0.2, ssl_context=ssl.create_default_context())
    try:
        await p.request(server.url, request(server.url), 1024, 5.0)
        assert server.open_now == 1
        for _ in range(50):
            await asyncio.sleep(0.05)
            if server.open_now == 0:
                break
        assert server.open_now == 0
        await p.request(server.url, request(server.url), 1024, 5.0)
        assert server.connections == 2
    finally:
        await p.close()


async def test_a_refused_connection_names_the_error(pool: Pool) -> None:
    url = URL(f"http://127.0.0.1:{closed_port()}/")
    with pytest.raises(ConnectFailed, match=r"cannot connect \(ConnectionRefusedError\)"):
        await pool.request(url, request(url), 1024, 5.0)


def test_the_host_header_leaves_out_the_default_port() -> None:
    assert host_header(URL("https://example.com/x")) == "example.com"
    assert host_header(URL("http://example.com:8080/x")) == "example.com:8080"
    assert host_header(URL("http://[::1]:8080/x")) == "[::1]:8080"
