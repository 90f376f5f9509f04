"""The logger of code that may run before anything set up structlog (the library in an
application, the relay reading its configuration): the application's own once it is set up,
else one that writes to stderr, never mixed into stdout."""

from __future__ import annotations

import sys
from typing import Any


def early_logger(name: str) -> Any:
    """structlog's logger ``name`` if structlog is configured, else a logger to stderr."""
    import structlog  # here, not at import: `import outbox` loads no logging library

    if structlog.is_configured():
        return structlog.get_logger(name)
    return structlog.wrap_logger(structlog.PrintLogger(sys.stderr))
