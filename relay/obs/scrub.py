"""The secrets this process knows of, and scrubbing them from anything it prints.

A command registers the secrets it was given (:func:`register`): ``run`` those of its
configuration once loaded (the database password, the SASL password, webhook secrets and
configured header values), the operations commands the password of ``--database-url``.
Error messages and every log event pass through :func:`scrub` as a last line of defence;
the first lines are not echoing inputs at all (config errors) and redacting URLs
(``outbox.dburl.redact``). Loading a configuration registers nothing by itself: its errors
are scrubbed of the secrets found in that input only.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable, Iterator, Mapping
from typing import Any
from urllib.parse import quote, quote_plus, unquote, urlsplit

from outbox.dburl import url_secrets

HIDDEN = "***"
# Shorter values are not scrubbed: replacing every "on" or "1" would garble everything.
MIN_LENGTH = 4
# A header whose name does not say it is a credential is scrubbed only from this length on.
MIN_PLAIN_HEADER_LENGTH = 8

# Config keys whose values are secret, whatever the section (typos included).
SECRET_KEY = re.compile(r"url|dsn|pass|secret|token|key|auth|credential|cookie|header", re.I)
_URL_KEY = re.compile(r"url|dsn", re.I)
_SECRET_HEADER = re.compile(r"auth|token|key|secret|pass|cookie|session|signature|credential", re.I)

_known: set[str] = set()
_pattern: re.Pattern[str] | None = None


def _forms(secret: str) -> set[str]:
    """The ways a secret may be written out: as is, JSON- or repr-escaped, percent-encoded."""
    return {
        secret,
        json.dumps(secret)[1:-1],
        json.dumps(secret, ensure_ascii=False)[1:-1],
        repr(secret)[1:-1],
        quote(secret, safe=""),
        quote_plus(secret, safe=""),
    }


def _compile(secrets: Iterable[str]) -> re.Pattern[str] | None:
    forms = {f for s in secrets for f in _forms(s) if len(f) >= MIN_LENGTH}
    if not forms:
        return None
    # Longest first, so a secret containing another is hidden whole.
    return re.compile("|".join(re.escape(f) for f in sorted(forms, key=len, reverse=True)))


def register(secrets: Iterable[str]) -> None:
    """Remember ``secrets`` (those of at least MIN_LENGTH characters) for :func:`scrub`."""
    global _pattern
    new = {s for s in secrets if len(s) >= MIN_LENGTH} - _known
    if new:
        _known.update(new)
        _pattern = _compile(_known)


def reset() -> None:
    """Forget every registered secret: a process starts with none, and a command forgets
    its own when it ends (commands run in-process, as tests do, do not leak into others)."""
    global _pattern
    _known.clear()
    _pattern = None


def scrub(text: str) -> str:
    """``text`` with every registered secret replaced."""
    pattern = _pattern
    return pattern.sub(HIDDEN, text) if pattern is not None else text


def hide(text: str, secrets: Iterable[str]) -> str:
    """``text`` with each of ``secrets`` (not the registered ones) replaced."""
    pattern = _compile(s for s in secrets if len(s) >= MIN_LENGTH)
    return pattern.sub(HIDDEN, text) if pattern is not None else text


def scrub_processor(logger: Any, method: str, event: Any) -> Any:
    """structlog processor, placed just before the renderer: every string in the event (and
    the text of any other object that holds a secret) has the known secrets replaced. Costs
    nothing while no secret is registered."""
    pattern = _pattern
    if pattern is None or not isinstance(event, dict):
        return event
    return {k: _scrub_value(v, pattern) for k, v in event.items()}


def _scrub_value(v: Any, pattern: re.Pattern[str]) -> Any:
    if isinstance(v, str):
        return pattern.sub(HIDDEN, v)
    if v is None or isinstance(v, bool | int | float):
        return v
    if isinstance(v, dict):
        return {k: _scrub_value(x, pattern) for k, x in v.items()}
    if isinstance(v, list | tuple | set | frozenset):
        return [_scrub_value(x, pattern) for x in v]
    text = repr(v)
    return pattern.sub(HIDDEN, text) if pattern.search(text) else v


# --- finding the secrets of a configuration --------------------------------------------------


def _strings(v: Any) -> Iterator[str]:
    if isinstance(v, str):
        yield v
    elif isinstance(v, Mapping):
        for x in v.values():
            yield from _strings(x)
    elif isinstance(v, list | tuple):
        for x in v:
            yield from _strings(x)


def _token_like(text: str) -> bool:
    """A random-looking piece of a URL (``/services/T0B1/XXXXXXXX``, ``?sig=…``): long, with
    letters and digits. Words such as ``hooks`` or ``json`` are not scrubbed."""
    return len(text) >= 8 and any(c.isdigit() for c in text) and any(c.isalpha() for c in text)


def _url_secrets(url: str) -> set[str]:
    """A URL's secrets: its password and secret-named parameters (``outbox.dburl``), and the
    token-like values of its query and segments of its path."""
    found = url_secrets(url)
    try:
        parts = urlsplit(url)
    except ValueError:
        return found
    pieces = [p.partition("=")[2] for p in parts.query.split("&")] + parts.path.split("/")
    found |= {x for p in pieces for x in (p, unquote(p)) if _token_like(x)}
    return found


def _value_secrets(key: str, value: str) -> set[str]:
    """What to hide of ``value``, found under the secret-bearing ``key``."""
    if "://" in value:
        return _url_secrets(value)
    if _URL_KEY.search(key):
        return url_secrets(value)  # libpq key=value settings, or unparseable: hidden whole
    return {value}  # a password, a token, a whsec_ secret


def _secret_env(name: Any, environ: Mapping[str, str]) -> set[str]:
    value = environ.get(name) if isinstance(name, str) else None
    if not value:
        return set()
    return {value, *(s for s in re.split(r"[\s,]+", value) if s)}


def config_secrets(data: Any, environ: Mapping[str, str] | None = None) -> set[str]:
    """Every secret value in a raw configuration (as read from TOML or JSON, whatever its
    shape): the strings under secret-bearing keys (database_url, url, passwords, secrets,
    headers, tokens, …), the parts of URLs that hold credentials, and the values of the
    variables ``secret_env`` names."""
    env = os.environ if environ is None else environ
    found: set[str] = set()

    def walk(node: Any, under_destinations: bool = False) -> None:
        if isinstance(node, list | tuple):
            for item in node:
                walk(item)
            return
        if not isinstance(node, Mapping):
            return
        for key, value in node.items():
            if under_destinations and isinstance(value, Mapping):
                walk(value)  # a destination's name is not a setting: look inside it only
            elif under_destinations and isinstance(value, str):
                found.update(_value_secrets("url", value))  # a destination as a bare URL
            elif key == "secret_env":
                found.update(_secret_env(value, env))
            elif key == "headers":
                found.update(_header_values(value))
            elif isinstance(key, str) and SECRET_KEY.search(key):
                for s in _strings(value):
                    found.update(_value_secrets(key, s))
            else:
                walk(value, under_destinations=key == "destinations")

    walk(data)
    return {s for s in found if s}


def _header_values(headers: Any) -> set[str]:
    if not isinstance(headers, Mapping):
        return set(_strings(headers))
    found: set[str] = set()
    for name, value in headers.items():
        for s in _strings(value):
            if _SECRET_HEADER.search(str(name)) or len(s) >= MIN_PLAIN_HEADER_LENGTH:
                found.add(s)
    return found


def environment_secrets(environ: Mapping[str, str], prefix: str = "OUTBOX_") -> set[str]:
    """Secrets in ``OUTBOX_*`` variables: the value of a secret-bearing one
    (``OUTBOX_DATABASE_URL``, ``OUTBOX_KAFKA_SASL_PLAIN_PASSWORD``), and those inside JSON
    values (``OUTBOX_DESTINATIONS``, ``OUTBOX_KAFKA``, …)."""
    found: set[str] = set()
    for name, value in environ.items():
        if not name.upper().startswith(prefix):
            continue
        key = name[len(prefix) :].lower()
        if SECRET_KEY.search(key):
            found.update(_value_secrets(key, value))
        try:
            parsed = json.loads(value)
        except ValueError:
            continue
        if key == "destinations" or key.startswith("destinations_"):
            parsed = {"destinations": parsed if key == "destinations" else {"_": parsed}}
        found |= config_secrets(parsed, environ)
    return found
