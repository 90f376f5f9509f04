"""Which errors the relay's statements may raise, and what each kind says: the database is
out of reach, it cannot take writes now, or it refused one statement on a sound connection."""

from __future__ import annotations

import asyncpg

# Errors that mean "the database is unreachable or restarting", as opposed to a bug.
# InternalClientError: asyncpg's on a connection closed mid-statement ("cannot switch to state
# …", MagicStack/asyncpg issue 1069); pool.connection discards it, so the retry gets a fresh one.
DB_ERRORS: tuple[type[BaseException], ...] = (
    OSError,
    TimeoutError,
    asyncpg.PostgresError,
    asyncpg.InterfaceError,
    asyncpg.InternalClientError,
)

# Errors that say the database cannot take this relay's writes right now, whatever is written:
# unreachable, restarting, read-only, out of connections, a grant missing, a lock or statement
# timeout. Work that hits one is kept and tried again later. Any other error the server
# reports for a statement may be about the values written (see the completer).
UNAVAILABLE: tuple[type[BaseException], ...] = (
    OSError,
    TimeoutError,
    asyncpg.InterfaceError,
    asyncpg.InternalClientError,
    asyncpg.PostgresConnectionError,
    asyncpg.OperatorInterventionError,
    asyncpg.InsufficientResourcesError,
    asyncpg.PostgresSystemError,
    asyncpg.ReadOnlySQLTransactionError,
    asyncpg.LockNotAvailableError,
    asyncpg.TransactionRollbackError,
    asyncpg.InsufficientPrivilegeError,
    asyncpg.InvalidAuthorizationSpecificationError,
    asyncpg.InvalidCatalogNameError,
)

# Errors that may come from a session default set when the connection was opened (a database
# or role made read-only, then not): the connection is replaced, so the next one sees the
# current settings.
SESSION_STALE: tuple[type[BaseException], ...] = (asyncpg.ReadOnlySQLTransactionError,)


def is_plain_sql_error(exc: BaseException) -> bool:
    """An error the server reported for the statement, on a connection that is still fine."""
    return isinstance(exc, asyncpg.PostgresError) and not isinstance(
        exc, asyncpg.PostgresConnectionError | asyncpg.AdminShutdownError
    )
