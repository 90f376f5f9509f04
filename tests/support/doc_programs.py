"""A page's whole programs, run as its reader runs them: each a process of its own, started in
the folder the page's files were written to (tests/support/doc_runner.py) with this checkout's
`python` and `outbox-relay`. What a page fixes and tests running side by side (pytest-xdist
workers) cannot share, a database, a port, a topic, is replaced by the test's own where the
page shows it, and nowhere else (``substitute``)."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from types import TracebackType

from tests.support.markdown import Block
from tests.support.signals import ctrl_c_default

# A `#` at the start of a line or after a space starts a comment (`run ...   # Ctrl-C once`).
_COMMENT = re.compile(r"(?:^|\s)#.*$")


def substitute(path: Path, changes: Mapping[str, str]) -> None:
    """``path`` with each key of ``changes`` replaced by its value. Each must be there exactly
    once: a page that moves or repeats one fails here, rather than run with what the test
    must not use (another test's database, a port taken)."""
    text = path.read_text()
    for old, new in changes.items():
        n = text.count(old)
        assert n == 1, f"{path.name} shows {old!r} {n} times, not once: the test replaces it"
        text = text.replace(old, new)
    path.write_text(text)


def command_lines(b: Block) -> list[str]:
    """A shell block's commands, one a line, without its comments and blank lines."""
    return [line for raw in b.code.splitlines() if (line := _COMMENT.sub("", raw).strip())]


def listening(port: int) -> bool:
    with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.2):
        return True
    return False


class Program:
    """A command run in the background (`cmd &`), in a process group of its own, its output in
    files beside the page's; stopped when its ``with`` block ends, whatever happened."""

    def __init__(
        self, name: str, argv: Sequence[str], cwd: Path, env: Mapping[str, str], *, quiet: bool
    ) -> None:
        self.name = name
        # Quiet: anything it writes to stderr is a failure (a receiver's traceback, say, which
        # leaves the server running and the sender retrying).
        self.quiet = quiet
        self._out, self._err = cwd / f"{name}.out", cwd / f"{name}.err"
        with self._out.open("wb") as out, self._err.open("wb") as err:
            self.proc = subprocess.Popen(
                list(argv),
                cwd=cwd,
                env=dict(env),
                stdout=out,
                stderr=err,
                start_new_session=True,
                preexec_fn=ctrl_c_default,  # interrupt() is Ctrl-C
            )

    def __enter__(self) -> Program:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)

    def out(self) -> str:
        return self._out.read_text(errors="replace")

    def output(self) -> str:
        return f"{self.out()}{self._err.read_text(errors='replace')}"

    def check(self) -> None:
        """Raises AssertionError, with what it printed, if it has stopped (or, quiet, wrote to
        stderr)."""
        code = self.proc.poll()
        if code is not None:
            raise AssertionError(f"{self.name} exited {code}:\n{self.output()}")
        if self.quiet and self._err.stat().st_size:
            self._settle()
            raise AssertionError(f"{self.name} failed:\n{self.output()}")

    def _settle(self, limit: float = 2.0) -> None:
        """Until its stderr stops growing: a traceback is written in pieces."""
        deadline = time.monotonic() + limit
        size = -1
        while size != (size := self._err.stat().st_size) and time.monotonic() < deadline:
            time.sleep(0.2)

    def interrupt(self, timeout: float = 15.0) -> int:
        """Ctrl-C (SIGINT to its process group, as a terminal sends it); its exit status."""
        os.killpg(self.proc.pid, signal.SIGINT)
        return self.proc.wait(timeout)


def wait_for(
    done: Callable[[], bool], *, timeout: float, what: str, watch: Sequence[Program]
) -> None:
    """Polls ``done`` until it holds; fails at once when a watched program stops (or, quiet,
    complains), and after ``timeout`` seconds with what the programs printed."""
    deadline = time.monotonic() + timeout
    while not done():
        for p in watch:
            p.check()
        if time.monotonic() > deadline:
            printed = "\n".join(f"--- {p.name}:\n{p.output()}" for p in watch)
            raise AssertionError(f"not {what} within {timeout:g} s\n{printed}")
        time.sleep(0.05)
