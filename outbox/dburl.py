"""Database URLs as users write them, turned into what each driver expects."""

from __future__ import annotations

from urllib.parse import urlsplit

_SCHEMES = ("postgresql", "postgres")


def to_asyncpg_dsn(url: str) -> str:
    """Accept ``postgresql://``, ``postgres://`` and SQLAlchemy ``postgresql+driver://`` URLs."""
    scheme, sep, rest = url.partition("://")
    base = scheme.split("+", 1)[0].lower()
    if not sep or base not in _SCHEMES:
        raise ValueError(
            f"database URL must start with postgresql:// (or postgresql+asyncpg://), "
            f"got {redact(url)!r}"
        )
    return f"postgresql://{rest}"


def to_sqlalchemy_async_url(url: str) -> str:
    return "postgresql+asyncpg://" + to_asyncpg_dsn(url).partition("://")[2]


def redact(url: str) -> str:
    """The URL with its password replaced, for logs and error messages."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return "<unparseable URL>"
    if parts.password is None:
        return url
    netloc = parts.netloc.replace(f":{parts.password}@", ":***@", 1)
    return parts._replace(netloc=netloc).geturl()
