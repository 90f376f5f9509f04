"""SSRF guard: webhooks may only reach public addresses unless a destination allows more.

The check happens inside the relay's HTTP client's connect step (GuardedResolver in
relay/sinks/webhook/client.py): the host is resolved once, every address is checked, and the
socket is opened to a checked address. There is no second DNS lookup between check and connect
for a rebinding attacker to answer differently. TLS still uses the URL's host name for SNI and
certificate checks, since only the TCP target changes.
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
from collections.abc import Iterable
from dataclasses import dataclass

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network

# IPv6 prefixes that carry an IPv4 address in their last 32 bits: judge the embedded one.
_NAT64 = (ipaddress.IPv6Network("64:ff9b::/96"), ipaddress.IPv6Network("64:ff9b:1::/48"))


class AddressRefused(Exception):
    """The host resolves to an address the destination's policy does not allow."""

    def __init__(self, host: str, addresses: Iterable[IPAddress]) -> None:
        self.host = host
        self.addresses = tuple(addresses)
        shown = ", ".join(str(a) for a in self.addresses)
        super().__init__(f"{host} resolves to non-public address(es) {shown}")


def embedded_ipv4(ip: ipaddress.IPv6Address) -> ipaddress.IPv4Address | None:
    if ip.ipv4_mapped is not None:
        return ip.ipv4_mapped
    if ip.sixtofour is not None:
        return ip.sixtofour
    if ip.teredo is not None:
        return ip.teredo[1]  # the client's address
    if any(ip in n for n in _NAT64):
        return ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF)
    return None


def is_public(ip: IPAddress) -> bool:
    """True only for globally routable unicast addresses.

    ``is_global`` alone is not enough: Python counts multicast (224.0.0.0/4) as global, and
    IPv4-mapped/6to4/NAT64 IPv6 addresses lead to the IPv4 address they embed.
    """
    if isinstance(ip, ipaddress.IPv6Address):
        inner = embedded_ipv4(ip)
        if inner is not None and not is_public(inner):
            return False
        if ip.ipv4_mapped is not None:
            return True  # the embedded IPv4 address is public; that is where it goes
    return not (
        not ip.is_global
        or ip.is_private
        or ip.is_loopback
        or ip.is_link_local
        or ip.is_multicast
        or ip.is_reserved
        or ip.is_unspecified
        or (isinstance(ip, ipaddress.IPv6Address) and ip.is_site_local)
    )


@dataclass(frozen=True, slots=True)
class AddressPolicy:
    """Which addresses a destination may connect to. Hashable: one connection pool each."""

    allow_private: bool = False
    allowed: tuple[IPNetwork, ...] = ()

    def permits(self, ip: IPAddress) -> bool:
        if self.allow_private or is_public(ip):
            return True
        candidates: list[IPAddress] = [ip]
        if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
            candidates.append(ip.ipv4_mapped)
        return any(c in net for c in candidates for net in self.allowed if c.version == net.version)


PUBLIC_ONLY = AddressPolicy()


async def resolve(host: str, port: int) -> list[IPAddress]:
    """Every address ``host`` resolves to, in the resolver's order, without duplicates."""
    try:
        return [ipaddress.ip_address(host.strip("[]"))]
    except ValueError:
        pass
    loop = asyncio.get_running_loop()
    infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    seen: dict[IPAddress, None] = {}
    for _family, _type, _proto, _canon, sockaddr in infos:
        seen.setdefault(ipaddress.ip_address(str(sockaddr[0])), None)
    return list(seen)
