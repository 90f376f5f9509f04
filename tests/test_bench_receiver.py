"""The benchmark's local receivers (relay.tools.bench.receiver) listen on ports they bound
themselves: no port number is picked first and bound later, when something else may hold it."""

from __future__ import annotations

import multiprocessing
import os
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

import relay.tools.localbroker
from relay.tools.bench import receiver
from relay.tools.bench.receiver import local_receiver, local_receivers
from relay.tools.localbroker import LocalBrokerError


@pytest.fixture
def taken_port(monkeypatch: pytest.MonkeyPatch) -> Iterator[int]:
    """A loopback port something else is listening on, handed out as the next "free" one."""
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = int(held.getsockname()[1])
        monkeypatch.setattr(relay.tools.localbroker, "free_port", lambda: port)
        monkeypatch.setattr(receiver, "free_port", lambda: port, raising=False)
        yield port


def test_receivers_listen_on_ports_of_their_own(taken_port: int, tmp_path: Path) -> None:
    with local_receivers([0.0, 0.0], tmp_path) as r:
        assert len(r.urls) == 2 and len({httpx.URL(u).port for u in r.urls}) == 2
        assert all(httpx.URL(u).port != taken_port for u in r.urls)
        for n, url in enumerate(r.urls):
            assert url.endswith(f"/hooks/{n}")
            res = httpx.post(url, content=b"{}", headers={"webhook-id": "7"}, timeout=5)
            assert res.status_code == 204
        assert r.received() == 2
        seen = r.stop()
    assert sorted((i, e) for i, e, _ in seen) == [(0, 7), (1, 7)]
    assert r.out.exists() and r.out.parent == tmp_path


def test_receivers_write_to_files_of_their_own(tmp_path: Path) -> None:
    with local_receivers([0.0], tmp_path) as a, local_receivers([0.0], tmp_path) as b:
        assert a.out != b.out


def test_receiver_listens_on_a_port_of_its_own(taken_port: int) -> None:
    with local_receiver() as r:
        assert httpx.URL(r.url).port != taken_port
        assert httpx.post(r.url, content=b"{}", timeout=5).status_code == 204


def _exits(*_: object) -> None:
    raise SystemExit(3)


def _never_listens(*_: object) -> None:
    time.sleep(30)


def test_a_receiver_process_that_ends_before_listening_is_reported() -> None:
    ctx = multiprocessing.get_context("spawn")
    with pytest.raises(LocalBrokerError, match="exit code 3"):
        receiver._start(ctx, _exits, (), 2)


def test_a_receiver_process_that_does_not_listen_in_time_is_reported_and_ended() -> None:
    ctx = multiprocessing.get_context("spawn")
    with pytest.raises(LocalBrokerError, match=r"not listening after 1\.0 s; ended it") as err:
        receiver._start(ctx, _never_listens, (), 1, timeout=1.0)
    pid = int(str(err.value).split("pid ")[1].split(")")[0])
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
