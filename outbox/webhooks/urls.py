"""Which URLs a webhook may be sent to: the check shared by the relay's configuration and the
endpoints an application registers at runtime."""

from __future__ import annotations

import ipaddress
import re

from yarl import URL

_LABEL = re.compile(r"^(?!-)[A-Za-z0-9_-]{1,63}(?<!-)$")
_NUMERIC = re.compile(r"^(0x[0-9a-f]*|[0-9]+)(\.(0x[0-9a-f]*|[0-9]+))*\.?$", re.IGNORECASE)


def _valid_host(host: str) -> bool:
    """A DNS name (IDNA already applied by yarl) or an IP address, nothing else."""
    try:
        ipaddress.ip_address(host.strip("[]"))
        return True
    except ValueError:
        pass
    if _NUMERIC.match(host):
        return False  # 127.1, 2130706433, 0x7f.1: an address in a form resolvers read loosely
    labels = host.rstrip(".").split(".")
    return len(host) <= 253 and all(_LABEL.match(label) for label in labels)


def check_url(v: str) -> str:
    """``v`` if it is a URL a webhook may be sent to (http/https, a valid host and port, no
    credentials, no control characters), else ValueError saying what is wrong without echoing
    any part that may be a credential. Endpoints registered at runtime are checked by it too."""
    if any(ord(c) < 0x20 or ord(c) == 0x7F for c in v):
        # The URL parser would silently drop CR, LF and tab: a request to another URL.
        raise ValueError("not a valid URL: it holds a control character (a line break?)")
    try:
        url = URL(v)
        port = url.explicit_port
    except (ValueError, TypeError) as exc:
        # The parser may quote the offending piece, which may be part of a credential (a
        # password read as the port): say what is wrong without it.
        text = str(exc).lower()
        what = next((w for w in ("port", "character", "too long") if w in text), "")
        problem = {
            "port": "its port is not a number from 0 to 65535",
            "character": "it holds a control character",
            "too long": "it is too long",
        }.get(what, "it cannot be parsed")
        raise ValueError(
            f"not a valid URL: {problem} (credentials belong in headers, not in the URL)"
        ) from None
    if url.scheme not in ("http", "https"):
        raise ValueError(f"must be an http:// or https:// URL, not {url.scheme or 'none'!r}")
    if not url.raw_host:
        raise ValueError("has no host")
    if not _valid_host(url.raw_host):
        raise ValueError(
            "its host is not a valid host name or IP address (letters, digits, hyphens "
            "and dots; no spaces or empty labels)"
        )
    if port is not None and not 1 <= port <= 65535:
        raise ValueError("its port must be a number from 1 to 65535")
    if url.raw_user is not None or url.raw_password is not None:
        raise ValueError(
            "must not carry credentials (user:password@); send them in headers, e.g. "
            'headers = { Authorization = "Basic …" }'
        )
    return v
