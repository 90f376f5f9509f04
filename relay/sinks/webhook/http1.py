"""The relay's HTTP/1.1 client for webhooks: one POST at a time per keep-alive connection,
answers parsed by httptools (llhttp), connections pooled per address policy.

Written for the request path rather than taken from a general client: a webhook is one
POST with a small body and a small answer, and aiohttp spent 130-160 µs of CPU on each on
this machine against 30-36 µs here (docs/performance.md, "A client of our own"). What it
does not do is on purpose: no redirects, proxies, cookies, decompression or pipelining.

The pool connects only to addresses its policy permits (``guarded_addresses``: a name is
resolved once per new connection and refused if any answer is outside the policy), and a
connection is never shared between policies.
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
import ssl
import time
from collections import deque
from dataclasses import dataclass

import httptools
from yarl import URL

from outbox.webhooks.ssrf import AddressPolicy, AddressRefused, IPAddress, resolve

MAX_HEAD = 65536  # bytes of status line and headers an answer may have

Key = tuple[str, str, int]  # scheme, host, port


class HttpError(Exception):
    """A transport failure, in words that say what failed and where."""


class DnsFailed(HttpError):
    def __init__(self, host: str, error: BaseException) -> None:
        super().__init__(f"DNS lookup of {host} failed: {error}")


class ConnectFailed(HttpError):
    def __init__(self, address: str, error: OSError) -> None:
        super().__init__(f"cannot connect ({type(error).__name__}): {error.strerror or error}")
        self.address = address


class CertificateNotTrusted(HttpError):
    def __init__(self, error: ssl.SSLCertVerificationError) -> None:
        super().__init__(f"TLS certificate not trusted: {error.verify_message or error}")


class Disconnected(HttpError):
    def __init__(self, answered: bool) -> None:
        super().__init__(
            "the server closed the connection in the middle of its answer"
            if answered
            else "ServerDisconnectedError: the server closed the connection without answering"
        )
        self.answered = answered


class PoolClosed(HttpError):
    """The client was closed (the sink stops) before the request went out."""


class BadAnswer(HttpError):
    """The answer is not HTTP/1.1 as a client can read it."""


@dataclass(slots=True, eq=False)
class Response:
    status: int
    headers: dict[str, str]  # lower-cased names; a repeated header keeps its last value
    body: bytes  # the first ``cap`` bytes of the body


async def guarded_addresses(host: str, port: int, policy: AddressPolicy) -> list[IPAddress]:
    """The addresses to connect to for ``host``: all of them permitted, or AddressRefused.
    One refused answer refuses the host: a mix of public and private answers is a classic
    rebinding set-up, and we would not know which one a retry reaches."""
    try:
        addresses = await resolve(host, port)
    except (OSError, UnicodeError) as exc:
        raise DnsFailed(host, exc) from exc
    if not addresses:
        raise DnsFailed(host, OSError("no address"))
    refused = [a for a in addresses if not policy.permits(a)]
    if refused:
        raise AddressRefused(host, refused)
    return addresses


class Connection(asyncio.Protocol):
    """One keep-alive connection: a request written, its answer parsed as it arrives."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.reusable = False
        self.idle_since = 0.0
        self._parser = httptools.HttpResponseParser(self)
        self._waiter: asyncio.Future[Response] | None = None
        self._cap = 0
        self._head_bytes = 0
        self._headers: dict[str, str] = {}
        self._status = 0
        self._body = bytearray()
        self._headers_done = False
        self._framed = False  # the answer says where it ends (length or chunks)
        self._answered = False  # a byte of the answer came

    # asyncio.Protocol

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports are not asyncio.Transport subclasses, only alike.
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        if self._waiter is None:
            # Bytes nobody asked for (a second answer, or junk): the connection's state is
            # unknown now, so it is not used again.
            self.close()
            return
        self._answered = True
        if not self._headers_done:
            if self._head_bytes > MAX_HEAD:
                self._fail(BadAnswer(f"the answer's head is over {MAX_HEAD} bytes"))
                return
            self._head_bytes += len(data)
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._finish(reusable=False)
        except httptools.HttpParserError as exc:
            self._fail(BadAnswer(f"not an HTTP/1.1 answer: {exc}"))

    def eof_received(self) -> bool:
        return False  # close our side too

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self._waiter is None or self._waiter.done():
            return
        if self._headers_done and not self._framed:
            self._finish(reusable=False)  # an answer that ends where the connection does
        else:
            self._fail(Disconnected(self._answered))

    # httptools callbacks

    def on_message_begin(self) -> None:
        if self._waiter is None:
            # Another answer after the one asked for, in the same read: the connection's
            # state is unknown (see data_received).
            self.close()

    def on_header(self, name: bytes, value: bytes) -> None:
        # Not a chunked answer's trailers: they are not needed, and would be unbounded.
        if self._waiter is not None and not self._headers_done:
            self._headers[name.decode("latin-1").lower()] = value.decode("latin-1")

    def on_headers_complete(self) -> None:
        self._status = self._parser.get_status_code()
        if 100 <= self._status < 200 and self._status != 101:
            return  # an interim answer (100 Continue, 103 Early Hints): the real one follows
        self._headers_done = True
        self._framed = (
            "content-length" in self._headers
            or "chunked" in self._headers.get("transfer-encoding", "").lower()
        )

    def on_body(self, body: bytes) -> None:
        if self._waiter is None:
            return
        room = self._cap - len(self._body)
        if len(body) <= room:
            self._body += body
            return
        # Past the cap: the rest is not read, and the connection is not reused.
        self._body += body[:room]
        self._finish(reusable=False)

    def on_message_complete(self) -> None:
        if self._waiter is None:
            return
        if not self._headers_done:  # the end of an interim answer
            self._headers, self._head_bytes = {}, 0
            return
        self._finish(reusable=self._parser.should_keep_alive())

    # the pool's side

    def exchange(self, data: list[bytes], cap: int) -> asyncio.Future[Response]:
        """Write one request; the future is its answer."""
        assert self.transport is not None and self._waiter is None
        loop = asyncio.get_running_loop()
        self._waiter = waiter = loop.create_future()
        self._cap, self._head_bytes, self._status = cap, 0, 0
        self._headers, self._body = {}, bytearray()
        self._headers_done = self._framed = self._answered = False
        self.reusable = False
        self.transport.writelines(data)
        return waiter

    def close(self) -> None:
        self.closed = True
        self.reusable = False
        if self.transport is not None:
            self.transport.close()

    def _finish(self, *, reusable: bool) -> None:
        waiter, self._waiter = self._waiter, None
        self.reusable = reusable and not self.closed
        if not reusable:
            self.close()
        answer = Response(self._status, self._headers, bytes(self._body))
        self._headers, self._body = {}, bytearray()  # what follows never changes this answer
        if waiter is not None and not waiter.done():
            waiter.set_result(answer)

    def _fail(self, exc: HttpError) -> None:
        waiter, self._waiter = self._waiter, None
        self.close()
        if waiter is not None and not waiter.done():
            waiter.set_exception(exc)


class Pool:
    """Keep-alive connections of one address policy: at most ``limit`` in use at once
    (callers wait for one beyond that), idle ones closed after ``keepalive`` seconds."""

    def __init__(
        self,
        policy: AddressPolicy,
        *,
        limit: int,
        keepalive: float,
        ssl_context: ssl.SSLContext,
    ) -> None:
        self.policy = policy
        self.limit = limit
        self.keepalive = keepalive
        self._ssl = ssl_context
        self._idle: dict[Key, deque[Connection]] = {}
        self._in_use: set[Connection] = set()
        self._busy = 0  # slots taken: connections in use and connects under way
        self._waiters: deque[asyncio.Future[None]] = deque()
        self._sweeper: asyncio.TimerHandle | None = None
        self._closed = False

    async def request(
        self, url: URL, data: list[bytes], cap: int, connect_timeout: float
    ) -> Response:
        """Send the request ``data`` (its head and body) to ``url``'s origin and return the
        answer with its body's first ``cap`` bytes. Cancelled (the caller's timeout): the
        connection is closed, its state unknown."""
        await self._slot()
        try:
            key: Key = (url.scheme, url.raw_host or "", url.port or 0)
            # A request is sent once: a reused connection the receiver closed as it went out
            # fails the attempt (Disconnected). Sent again here, the receiver could get it
            # twice in one attempt, and the message log must count every request sent.
            conn = self._reuse(key)
            if conn is None:
                conn = await self._connect(key, connect_timeout)
                if self._closed:  # closed while it connected: nothing goes out now
                    conn.close()
                    self._check_open()
            self._in_use.add(conn)
            try:
                response = await conn.exchange(data, cap)
            except BaseException:
                conn.close()
                raise
            finally:
                self._in_use.discard(conn)
            if conn.reusable and not self._closed:
                conn.idle_since = time.monotonic()
                self._idle.setdefault(key, deque()).append(conn)
                self._sweep_later()
            else:
                conn.close()
            return response
        finally:
            self._release()

    async def close(self) -> None:
        self._closed = True
        if self._sweeper is not None:
            self._sweeper.cancel()
            self._sweeper = None
        for conns in self._idle.values():
            for conn in conns:
                conn.close()
        self._idle.clear()
        for conn in list(self._in_use):
            conn.close()
        while self._waiters:  # each raises: the pool is closed
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)

    def _check_open(self) -> None:
        if self._closed:
            raise PoolClosed("not sent: the relay's HTTP client is closed")

    async def _slot(self) -> None:
        self._check_open()
        while self._busy >= self.limit:
            waiter = asyncio.get_running_loop().create_future()
            self._waiters.append(waiter)
            try:
                await waiter
            except BaseException:
                if waiter.done() and not waiter.cancelled():
                    self._wake_next()  # the slot handed to us goes to the next in line
                raise
            self._check_open()
        self._busy += 1

    def _release(self) -> None:
        self._busy -= 1
        self._wake_next()

    def _wake_next(self) -> None:
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return

    def _reuse(self, key: Key) -> Connection | None:
        self._check_open()
        idle = self._idle.get(key)
        now = time.monotonic()
        while idle:
            conn = idle.pop()  # the most recently used: the least likely to have expired
            if not conn.closed and now - conn.idle_since < self.keepalive:
                return conn
            conn.close()
        return None

    async def _connect(self, key: Key, timeout: float) -> Connection:
        scheme, host, port = key
        tls = scheme == "https"
        try:
            literal: IPAddress | None = ipaddress.ip_address(host.strip("[]"))
        except ValueError:
            literal = None
        # A literal is checked when its target is built (literal_refusal), once.
        addresses = [literal] if literal is not None else await self._addresses(host, port)
        loop = asyncio.get_running_loop()
        error: OSError | None = None
        for address in addresses:
            try:
                async with asyncio.timeout(timeout):
                    _, conn = await loop.create_connection(
                        Connection,
                        str(address),
                        port,
                        ssl=self._ssl if tls else None,
                        server_hostname=host.strip("[]") if tls else None,
                        family=socket.AF_INET6 if address.version == 6 else socket.AF_INET,
                    )
                return conn
            except ssl.SSLCertVerificationError as exc:
                raise CertificateNotTrusted(exc) from exc
            except TimeoutError:
                error = TimeoutError(f"no connection within {timeout:g} s")
            except OSError as exc:
                error = exc
        assert error is not None
        raise ConnectFailed(f"{host}:{port}", error)

    async def _addresses(self, host: str, port: int) -> list[IPAddress]:
        return await guarded_addresses(host, port, self.policy)

    def _sweep_later(self) -> None:
        if self._sweeper is None and not self._closed:
            loop = asyncio.get_running_loop()
            self._sweeper = loop.call_later(self.keepalive, self._sweep)

    def _sweep(self) -> None:
        self._sweeper = None
        now = time.monotonic()
        for key in list(self._idle):
            idle = self._idle[key]
            while idle and (idle[0].closed or now - idle[0].idle_since >= self.keepalive):
                idle.popleft().close()
            if not idle:
                del self._idle[key]
        if self._idle:
            self._sweep_later()


class Pools:
    """One pool per address policy, opened on first use."""

    def __init__(
        self, limit: int, keepalive: float, ssl_context: ssl.SSLContext | None = None
    ) -> None:
        self.limit = limit
        self.keepalive = keepalive
        self._ssl = ssl_context or ssl.create_default_context()
        self._pools: dict[AddressPolicy, Pool] = {}

    def get(self, policy: AddressPolicy) -> Pool:
        pool = self._pools.get(policy)
        if pool is None:
            pool = self._pools[policy] = Pool(
                policy, limit=self.limit, keepalive=self.keepalive, ssl_context=self._ssl
            )
        return pool

    async def close(self) -> None:
        pools, self._pools = list(self._pools.values()), {}
        for pool in pools:
            await pool.close()


def host_header(url: URL) -> str:
    host = url.raw_host or ""
    if ":" in host:
        host = f"[{host}]"
    port = url.explicit_port
    if port is None or port == {"http": 80, "https": 443}.get(url.scheme):
        return host
    return f"{host}:{port}"


__all__ = [
    "BadAnswer",
    "CertificateNotTrusted",
    "ConnectFailed",
    "Connection",
    "Disconnected",
    "DnsFailed",
    "HttpError",
    "Pool",
    "PoolClosed",
    "Pools",
    "Response",
    "guarded_addresses",
    "host_header",
]
