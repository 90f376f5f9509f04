"""Whether each standard stream is a terminal: prompts are asked only on one (stdin), `status
--watch` redraws only on one (stdout), progress is shown only on one (stderr). One place for
the commands to ask, and for a test to stand in for a terminal."""

from __future__ import annotations

import sys


def stdin() -> bool:
    return sys.stdin.isatty()


def stdout() -> bool:
    return sys.stdout.isatty()


def stderr() -> bool:
    return sys.stderr.isatty()
