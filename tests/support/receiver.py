"""A real HTTP server on loopback that records webhook requests.

Tests script its answers: ``receiver.respond(status=500, times=2)`` makes the next two
requests fail, ``respond(delay=1.0)`` slows them, ``respond(headers={"Retry-After": "3"})``,
``respond(reset=True)`` drops the connection without an answer (a TCP reset).
``max_in_flight`` is the most requests it ever handled at the same time.
``go_away()`` takes the server down (its port refuses connections, and the connections it had
open are closed, their requests unanswered) and ``come_back()`` listens on the same port again.
"""

from __future__ import annotations

import contextlib
import socket
import struct
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


@dataclass
class Recorded:
    method: str
    path: str
    headers: dict[str, str]
    body: bytes
    at: float
    status: int | None = None  # what it was answered (None: reset, or still answering)
    done: float | None = None  # when the answer was sent


@dataclass
class Script:
    status: int = 200
    delay: float = 0.0
    headers: dict[str, str] = field(default_factory=dict)
    body: bytes = b""
    times: int | None = None  # None: for every request until replaced
    reset: bool = False  # close the connection with a TCP RST instead of answering


class Receiver:
    def __init__(self, port: int = 0) -> None:
        self.requests: list[Recorded] = []
        self._scripts: deque[Script] = deque()
        self._default = Script()
        self._chooser: Callable[[], Script] | None = None
        self.in_flight = 0
        self.max_in_flight = 0
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        # The connections the server has accepted and not yet closed (go_away closes them).
        self._connections: set[socket.socket] = set()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"  # keep-alive, as real endpoints do

            def do_POST(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length)
                script = receiver._next_script()
                rec = Recorded(
                    "POST",
                    self.path,
                    {k.lower(): v for k, v in self.headers.items()},
                    body,
                    time.monotonic(),
                )
                with receiver._cond:
                    receiver.requests.append(rec)
                    receiver.in_flight += 1
                    receiver.max_in_flight = max(receiver.max_in_flight, receiver.in_flight)
                    receiver._cond.notify_all()
                try:
                    if script.delay:
                        time.sleep(script.delay)
                    if script.reset:
                        self.connection.setsockopt(
                            socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0)
                        )
                        self.connection.close()  # linger 0: the peer gets a reset
                        self.close_connection = True
                        rec.done = time.monotonic()  # status stays None: no answer
                        return
                    # Stamped before the answer leaves: anything the client does after
                    # reading it (the next request) is recorded later than this.
                    with receiver._cond:
                        rec.status, rec.done = script.status, time.monotonic()
                        receiver._cond.notify_all()  # for waits on answers, not only requests
                    self.send_response(script.status)
                    for k, v in script.headers.items():
                        self.send_header(k, v)
                    self.send_header("Content-Length", str(len(script.body)))
                    self.end_headers()
                    self.wfile.write(script.body)
                    self.wfile.flush()
                except (BrokenPipeError, ConnectionResetError):
                    rec.status = rec.done = None  # the client never read an answer
                    self.close_connection = True  # the client gave up first (its timeout)
                finally:
                    with receiver._cond:
                        receiver.in_flight -= 1

            def log_message(self, format: str, *args: object) -> None:
                pass

        class Server(ThreadingHTTPServer):
            # The default backlog of 5 drops SYNs when a relay opens many connections at
            # once, which looks like a slow endpoint; real servers listen with far more.
            request_queue_size = 128

            def process_request(self, request: Any, client_address: Any) -> None:
                # Noted in the accepting thread, before its handler's: once shutdown()
                # returns, every connection accepted is in the set.
                with receiver._lock:
                    receiver._connections.add(request)
                super().process_request(request, client_address)

            def shutdown_request(self, request: Any) -> None:
                with receiver._lock:
                    receiver._connections.discard(request)
                super().shutdown_request(request)

        self._server_class, self._handler = Server, Handler
        self._listen(port)
        self.port = self.server.server_address[1]

    def _listen(self, port: int) -> None:
        self.server = self._server_class(("127.0.0.1", port), self._handler)
        self.server.daemon_threads = True
        # A short poll interval: stop() waits for one, once per test.
        self._thread = threading.Thread(
            target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        )

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def respond(
        self,
        status: int = 200,
        *,
        delay: float = 0.0,
        headers: dict[str, str] | None = None,
        body: bytes = b"",
        times: int | None = None,
        reset: bool = False,
    ) -> None:
        script = Script(status, delay, headers or {}, body, times, reset)
        with self._lock:
            if times is None:
                self._default = script
            else:
                self._scripts.append(script)

    def respond_with(self, choose: Callable[[], Script] | None) -> None:
        """Let ``choose()`` script every request (e.g. random failures); None: back to normal."""
        with self._lock:
            self._chooser = choose

    def _next_script(self) -> Script:
        with self._lock:
            if self._chooser is not None:
                return self._chooser()
            while self._scripts:
                s = self._scripts[0]
                assert s.times is not None
                if s.times > 0:
                    s.times -= 1
                    if s.times == 0:
                        self._scripts.popleft()
                    return s
                self._scripts.popleft()
            return self._default

    def wait_for(self, count: int, timeout: float = 10.0) -> list[Recorded]:
        deadline = time.monotonic() + timeout
        with self._cond:
            while len(self.requests) < count:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"got {len(self.requests)} requests, wanted {count}")
                self._cond.wait(left)
            return list(self.requests)

    def wait_until(
        self, predicate: Callable[[list[Recorded]], bool], timeout: float = 10.0
    ) -> list[Recorded]:
        """Block until ``predicate(requests)`` holds, or fail after ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while not predicate(self.requests):
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"condition not met; got {len(self.requests)} requests")
                self._cond.wait(left)
            return list(self.requests)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def go_away(self) -> None:
        """The endpoint's server goes down: its port refuses connections, and the connections
        it had open are shut down, so that a request still waiting for its answer (a scripted
        delay) never gets one: the client reads the end of the connection, and the handler's
        answer fails (recorded without a status)."""
        self.stop()
        with self._lock:
            connections = list(self._connections)
        for conn in connections:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)

    def come_back(self) -> None:
        """Listen again on the same port (the URL the endpoint was registered with), answering
        as scripted; what it received before is kept."""
        self._listen(self.port)
        self.start()
