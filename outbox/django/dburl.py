"""The ``postgresql://`` URL of a Django ``DATABASES`` entry, for ``outbox_migrate``.

The migration runner connects with asyncpg, not with libpq, so a ``DATABASES`` entry is
turned into a URL asyncpg reads the way libpq would read the entry's settings. What asyncpg
cannot carry is refused rather than left out when it may change which server is reached or
how safely (a ``service`` whose file asyncpg does not read would migrate whatever server
answers by default); what has no bearing on that (Django's and psycopg's own options,
timeouts, keepalives) is left out. Nothing here touches Django's settings: it is a pure
function of one entry.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any
from urllib.parse import quote, urlencode

# libpq options that asyncpg reads from a URL with the same meaning: carried. ``options``
# (e.g. "-c search_path=app") goes to the server in the startup packet, as libpq sends it.
CARRIED = (
    "sslmode",
    "sslrootcert",
    "sslcert",
    "sslkey",
    "sslcrl",
    "sslpassword",
    "sslnegotiation",
    "ssl_min_protocol_version",
    "ssl_max_protocol_version",
    "passfile",
    "target_session_attrs",
    "krbsrvname",
    "gsslib",
    "options",
)
# Options with no bearing on which server is reached or how safely: left out.
IGNORED = frozenset(
    {
        # Django's own (not libpq's)
        "isolation_level",
        "server_side_binding",
        "pool",
        # psycopg's
        "cursor_factory",
        "prepare_threshold",
        "context",
        "row_factory",
        "autocommit",
        # libpq's: the migration sets its own application_name and encoding, and waits
        # asyncpg's connect timeout (60 s)
        "client_encoding",
        "application_name",
        "fallback_application_name",
        "connect_timeout",
        "keepalives",
        "keepalives_idle",
        "keepalives_interval",
        "keepalives_count",
        "tcp_user_timeout",
        "load_balance_hosts",
        "sslsni",
        "sslcompression",
    }
)
# Ignored unless they require what asyncpg does not do (GSS encryption, channel binding).
_UNLESS_REQUIRED = ("gssencmode", "channel_binding")


class UnusableDatabaseSettings(ValueError):
    """The entry cannot be migrated faithfully by ``outbox_migrate``; the text says why and
    what to do. It never holds a password or an option's value."""


def database_url(db: Mapping[str, Any], alias: str = "default") -> str:
    """The ``postgresql://`` URL of a ``DATABASES`` entry: NAME, USER, PASSWORD, HOST (a
    name, an IP address, a Unix socket directory, or a comma-separated list of them), PORT
    (one, or one per host) and the OPTIONS of :data:`CARRIED`. An empty HOST means the
    default (PGHOST, else the local socket), as for Django. Raises
    :class:`UnusableDatabaseSettings`."""
    where = f"DATABASES[{alias!r}]"
    instead = (
        f"give NAME, HOST, PORT and USER (and PASSWORD, or OPTIONS['passfile']) in {where} "
        "instead, or run outbox-relay migrate --database-url postgresql://USER@HOST:PORT/NAME"
    )
    name = db.get("NAME") or ""
    if not name:
        raise UnusableDatabaseSettings(f"{where} needs a NAME for outbox_migrate; {instead}")
    options = db.get("OPTIONS") or {}
    query = _carried_options(options, where, instead)

    user, password = db.get("USER") or "", db.get("PASSWORD") or ""
    host, port = str(db.get("HOST") or ""), str(db.get("PORT") or "")
    hosts = host.split(",") if host else []
    ports = port.split(",") if port else []
    if any(not p.strip().isdigit() for p in ports):
        raise UnusableDatabaseSettings(f"{where}: PORT must be a number (or one per host)")
    ports = [p.strip() for p in ports]
    if len(ports) > 1 and len(ports) != max(len(hosts), 1):
        raise UnusableDatabaseSettings(
            f"{where}: PORT lists {len(ports)} ports for {len(hosts)} hosts; give one port, "
            "or one per host"
        )
    if any(not h for h in hosts):
        raise UnusableDatabaseSettings(f"{where}: HOST lists an empty host")
    hosts = [f"[{h}]" if ":" in h and not h.startswith("[") else h for h in hosts]

    netloc = ""
    if not hosts or any(h.startswith("/") for h in hosts):
        # The default host, or Unix socket directories: in the query, as libpq takes them.
        if hosts:
            query["host"] = ",".join(hosts)
        if ports:
            query["port"] = ",".join(ports)
    else:
        if len(ports) == 1:
            ports *= len(hosts)
        with_ports = [f"{h}:{p}" for h, p in zip(hosts, ports, strict=False)]
        netloc = ",".join(with_ports or hosts)
    userinfo = quote(user, safe="") + (":" + quote(password, safe="") if password else "")
    url = f"postgresql://{userinfo}{'@' if userinfo else ''}{netloc}/{quote(name, safe='')}"
    return f"{url}?{urlencode(query)}" if query else url


def _carried_options(options: Mapping[str, Any], where: str, instead: str) -> dict[str, str]:
    query: dict[str, str] = {}
    for key, value in options.items():
        if key in CARRIED:
            if value is not None and str(value) != "":
                query[key] = str(value)
            continue
        if key in IGNORED:
            continue
        if key in _UNLESS_REQUIRED and str(value).lower() != "require":
            continue
        if key == "assume_role" and not value:
            continue  # no role to assume
        option = f"{where}['OPTIONS'][{key!r}]"
        if key == "service":
            why = (
                "is not read by outbox_migrate: its driver (asyncpg) does not read every "
                "service file libpq does, and would then migrate whatever server answers by "
                "default"
            )
        elif key == "assume_role":
            why = (
                "cannot be followed by outbox_migrate (it does not SET ROLE): the outbox "
                "tables would be owned by USER, not by the role the application works as"
            )
        elif key in _UNLESS_REQUIRED:
            why = "= 'require' asks for what outbox_migrate's driver (asyncpg) cannot do"
        else:
            why = (
                "cannot be passed to outbox_migrate's driver (asyncpg), and may change which "
                "server is reached or how"
            )
        raise UnusableDatabaseSettings(f"{option} {why}: {instead}")
    return query
