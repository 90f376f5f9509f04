"""Database URLs as users write them, turned into what each driver expects.

Nothing here ever echoes a password: :func:`redact` hides it in every shape a user may
write (URL userinfo, query parameters, libpq ``key=value`` strings) and shows nothing of what
it cannot parse; errors quote only the redacted form.
"""

from __future__ import annotations

import re
from urllib.parse import unquote, urlsplit

_SCHEMES = ("postgresql", "postgres")

# Parameter names whose values are secret: password, sslpassword, api_token, …
SECRET_NAME = re.compile(r"pass|secret|token|key|auth|credential", re.IGNORECASE)
_SCHEME = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*")
_QUERY_PARAM = re.compile(r"(?P<sep>^|[?&;])(?P<name>[^=&;?#]*)=(?P<value>[^&;#]*)")
HIDDEN = "***"
UNPARSEABLE = "<not shown: neither a URL nor key=value settings>"


def to_asyncpg_dsn(url: str) -> str:
    """Accept ``postgresql://``, ``postgres://`` and SQLAlchemy ``postgresql+driver://`` URLs."""
    scheme, sep, rest = url.partition("://")
    base = scheme.split("+", 1)[0].lower()
    if not sep or base not in _SCHEMES:
        hint = (
            " (libpq key=value settings are not accepted: write postgresql://user:password@"
            "host:port/dbname)"
            if not sep and keyword_settings(url)
            else ""
        )
        raise ValueError(
            f"database URL must start with postgresql:// (or postgresql+asyncpg://), "
            f"got {redact(url)!r}{hint}"
        )
    _check_authority(url, rest)
    return f"postgresql://{rest}"


def _check_authority(url: str, rest: str) -> None:
    """Refuse what asyncpg would misread, since its errors quote the misread pieces (a piece
    of the password reported as a port or a query field)."""
    encode = (
        "; percent-encode any of / ? # @ : [ ] in the user name or password "
        "(/ is %2F, ? is %3F, # is %23, @ is %40)"
    )
    try:
        parts = urlsplit(url)
    except ValueError:
        raise ValueError(f"database URL {redact(url)!r} is not a valid URL{encode}") from None
    libpq_authority = rest.split("/", 1)[0]
    if "@" not in parts.netloc and (
        "@" in libpq_authority or "@" in parts.path or "@" in parts.fragment
    ):
        raise ValueError(
            f"database URL {redact(url)!r}: its user name or password ends the host part "
            f"early{encode}"
        )
    for host in parts.netloc.rpartition("@")[2].split(","):
        if host.startswith("["):
            port = host.partition("]")[2].removeprefix(":")
        else:
            port = host.rpartition(":")[2] if ":" in host else ""
        if port and not port.isdigit():
            raise ValueError(f"database URL {redact(url)!r}: the port is not a number{encode}")


def to_sqlalchemy_async_url(url: str) -> str:
    return "postgresql+asyncpg://" + to_asyncpg_dsn(url).partition("://")[2]


def keyword_settings(text: str) -> list[tuple[str, str]] | None:
    """``key=value`` pairs of a libpq connection string (values may be single-quoted, with
    backslash escapes), or None if ``text`` is not one."""
    pairs: list[tuple[str, str]] = []
    i, n = 0, len(text)
    while True:
        while i < n and text[i].isspace():
            i += 1
        if i == n:
            return pairs
        start = i
        while i < n and not text[i].isspace() and text[i] not in "='":
            i += 1
        key = text[start:i]
        while i < n and text[i].isspace():
            i += 1
        if not key or i == n or text[i] != "=":
            return None
        i += 1
        while i < n and text[i].isspace():
            i += 1
        value: list[str] = []
        if i < n and text[i] == "'":
            i += 1
            while True:
                if i == n:
                    return None  # unterminated quote
                c = text[i]
                if c == "\\" and i + 1 < n:
                    value.append(text[i + 1])
                    i += 2
                elif c == "'":
                    i += 1
                    break
                else:
                    value.append(c)
                    i += 1
        else:
            while i < n and not text[i].isspace():
                if text[i] == "\\" and i + 1 < n:
                    i += 1
                value.append(text[i])
                i += 1
        pairs.append((key, "".join(value)))


def _quote(value: str) -> str:
    if value and not any(c.isspace() or c in "'\\" for c in value):
        return value
    return "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"


def redact(url: str) -> str:
    """The URL (or libpq ``key=value`` string) with every secret replaced by ``***``, for
    logs and error messages. Input that is neither is not shown at all."""
    scheme, sep, rest = url.partition("://")
    if sep and _SCHEME.fullmatch(scheme):
        # Up to the last @: a password holding / ? # or @ still counts as the password.
        userinfo, at, hostpart = rest.rpartition("@")
        if at:
            user, colon, _ = userinfo.partition(":")
            rest = f"{user}:{HIDDEN}@{hostpart}" if colon else rest
        rest = _QUERY_PARAM.sub(_hide_param, rest)
        return f"{scheme}://{rest}"
    pairs = keyword_settings(url)
    if pairs is None:
        return UNPARSEABLE
    return " ".join(f"{k}={HIDDEN if SECRET_NAME.search(k) else _quote(v)}" for k, v in pairs)


def _hide_param(m: re.Match[str]) -> str:
    if not SECRET_NAME.search(unquote(m["name"])):
        return m[0]
    return f"{m['sep']}{m['name']}={HIDDEN}"


def url_secrets(url: str) -> set[str]:
    """Every secret a database URL (or libpq string) holds, as written and percent-decoded:
    what must never be printed. Input that cannot be parsed counts as secret whole."""
    found: set[str] = set()
    scheme, sep, rest = url.partition("://")
    if sep and _SCHEME.fullmatch(scheme):
        userinfo, at, _ = rest.rpartition("@")
        if at and ":" in userinfo:
            found.add(userinfo.partition(":")[2])
        for m in _QUERY_PARAM.finditer(rest):
            if SECRET_NAME.search(unquote(m["name"])):
                found.add(m["value"])
    else:
        pairs = keyword_settings(url)
        if pairs is None:
            found.add(url)
        else:
            found.update(v for k, v in pairs if SECRET_NAME.search(k))
    found |= {unquote(s) for s in found}
    return {s for s in found if s}
