"""outbox.endpoints.DNS_TIMEOUT, set by an application, bounds a registration's wait for DNS
(as it did before outbox.endpoints became a package: the review of issue #28 found the
package's name for it had become a copy that nothing read)."""

from __future__ import annotations

import socket
import time

import pytest

import outbox.endpoints as eps
from outbox.errors import OutboxValidationError


def test_the_dns_timeout_set_on_outbox_endpoints_is_the_one_waited(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def stuck(*args: object, **kwargs: object) -> list[object]:
        time.sleep(2.0)  # a resolver that does not answer in time
        return []

    monkeypatch.setattr(socket, "getaddrinfo", stuck)
    monkeypatch.setattr(eps, "DNS_TIMEOUT", 0.2)
    started = time.monotonic()
    with pytest.raises(OutboxValidationError, match=r"did not resolve within 0\.2 s"):
        eps.check_reachable("https://hooks.example.test/in")
    assert time.monotonic() - started < 1.5


def test_the_default_is_five_seconds() -> None:
    assert eps.DNS_TIMEOUT == 5.0
