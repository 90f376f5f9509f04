"""structlog set-up: JSON lines for machines, readable lines in a terminal.

Every event passes through :func:`relay.obs.scrub.scrub_processor` just before it is rendered,
and the standard library's records (aiokafka's, for one) through a scrubbing formatter: a
secret the configuration registered is never printed, even by a log call that forgot it.
"""

from __future__ import annotations

import logging
import sys
from typing import Literal

import structlog

from relay.obs import scrub


class ScrubbingFormatter(logging.Formatter):
    """Formats a standard library record, then hides the registered secrets in it."""

    def format(self, record: logging.LogRecord) -> str:
        return scrub.scrub(super().format(record))


_STDLIB_HANDLER = "outbox-relay-stderr"


def configure(level: str = "info", fmt: Literal["auto", "json", "console"] = "auto") -> None:
    use_json = fmt == "json" or (fmt == "auto" and not sys.stdout.isatty())
    renderer: structlog.typing.Processor = (
        structlog.processors.JSONRenderer()
        if use_json
        else structlog.dev.ConsoleRenderer(colors=sys.stdout.isatty())
    )
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            scrub.scrub_processor,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(
            logging.getLevelNamesMapping()[level.upper()]
        ),
        logger_factory=structlog.PrintLoggerFactory(sys.stdout),
        cache_logger_on_first_use=True,
    )
    # Libraries log through the standard library: warnings and errors go to stderr, as
    # Python's last-resort handler sent them, but scrubbed.
    root = logging.getLogger()
    if not any(h.get_name() == _STDLIB_HANDLER for h in root.handlers):
        handler = logging.StreamHandler(sys.stderr)
        handler.set_name(_STDLIB_HANDLER)
        handler.setLevel(logging.WARNING)
        handler.setFormatter(ScrubbingFormatter("%(levelname)s %(name)s: %(message)s"))
        root.addHandler(handler)
