"""Whether an endpoint's URL may be registered: its host must resolve, within DNS_TIMEOUT, to
public addresses only (unless the destination allows private networks)."""

from __future__ import annotations

import concurrent.futures
import ipaddress
import socket

from outbox.errors import OutboxValidationError
from outbox.webhooks.ssrf import is_public

DNS_TIMEOUT = 5.0  # seconds a registration waits for the URL's host to resolve


def _dns_timeout() -> float:
    """DNS_TIMEOUT as outbox.endpoints has it at this moment: an application sets it there
    (the package's name for it, from before the package was split)."""
    import outbox.endpoints

    return float(outbox.endpoints.DNS_TIMEOUT)


def check_reachable(
    url: str, allow_private_networks: bool = False, *, resolve: bool = True
) -> None:
    """Refuse a URL whose host does not resolve, or resolves to a private, loopback or other
    non-public address (unless allowed): the relay would refuse to deliver to it anyway. An IP
    literal is checked even when ``resolve`` is off (nothing to look up)."""
    from yarl import URL

    parsed = URL(url)
    host = parsed.raw_host or ""
    try:
        addresses = [ipaddress.ip_address(host.strip("[]"))]
    except ValueError:
        if not resolve:
            return
        addresses = _lookup(host, parsed.port or 443)
    refused = [a for a in addresses if not is_public(a)]
    if refused and not allow_private_networks:
        shown = ", ".join(map(str, refused))
        raise OutboxValidationError(
            "url",
            f"its host {host!r} is or resolves to non-public address(es) {shown}; endpoints "
            "may only be public unless the destination sets allow_private_networks = true "
            "(then pass allow_private_networks=True / --allow-private-networks)",
        )


def _lookup(host: str, port: int) -> list[ipaddress.IPv4Address | ipaddress.IPv6Address]:
    """The host's addresses, or OutboxValidationError if it does not resolve within
    DNS_TIMEOUT (getaddrinfo itself has no timeout: a stuck resolver would hang the call)."""
    timeout = _dns_timeout()
    pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="outbox-dns")
    try:
        future = pool.submit(socket.getaddrinfo, host, port, type=socket.SOCK_STREAM)
        infos = future.result(timeout=timeout)
    except concurrent.futures.TimeoutError:
        raise OutboxValidationError(
            "url",
            f"its host {host!r} did not resolve within {timeout:g} s; check the DNS, or "
            "pass check_dns=False (--no-dns-check) to register it unresolved",
        ) from None
    except (OSError, UnicodeError) as exc:
        raise OutboxValidationError(
            "url", f"its host {host!r} does not resolve ({exc}); check the spelling"
        ) from None
    finally:
        pool.shutdown(wait=False)
    return list(dict.fromkeys(ipaddress.ip_address(str(i[4][0])) for i in infos))
