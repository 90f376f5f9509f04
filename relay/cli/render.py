"""The commands' text output for people, in one place: every line through echo() (escaped by
printable(), coloured by Tint), tables, ages, fields, confirmations on the terminal, and a
line of progress redrawn in place. JSON (echo_json) and text meant for another program
(echo_exact) go out as they are."""

from __future__ import annotations

import asyncio
import json
import os
import re
import time
import unicodedata
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any, TypeVar

import asyncpg
import click

from relay.cli import terminal
from relay.ops.text import age as age

T = TypeVar("T")


def echo_json(data: Any) -> None:
    click.echo(json.dumps(data, indent=2, default=str))


# --- colour ---------------------------------------------------------------------------------

# States in text output, the same colour in every command: green is fine (delivered, enabled,
# active, running), yellow waits on someone (paused), red needs a look (failed, disabled, an
# open circuit, a silent relay).
GOOD, WAITING, BAD = "green", "yellow", "red"
# A row's or a delivery's status.
STATUS_COLOURS = {"delivered": GOOD, "failed": BAD}


def colour_wanted() -> bool:
    """Whether text output may be coloured: as ``--color``/``--no-color`` of ``outbox-relay``
    say, else unless NO_COLOR is set to anything but "" (https://no-color.org). click.echo
    strips the colour again where the output is not a terminal (unless ``--color``), and
    JSON is never coloured."""
    ctx = click.get_current_context(silent=True)
    if ctx is not None and ctx.color is not None:
        return ctx.color
    return not os.environ.get("NO_COLOR")


def paint(text: str, colour: str | None) -> str:
    """``text`` in ``colour`` (GOOD, WAITING, BAD), when colour is wanted."""
    return click.style(text, fg=colour) if colour and colour_wanted() else text


class Tint(str):
    """A part of a line (a table cell) to print in a colour: escaped, aligned by the text it
    then is (escape codes take no room on the screen), and painted, its padding left plain."""

    colour: str | None

    def __new__(cls, text: str, colour: str | None) -> Tint:
        cell = super().__new__(cls, text)
        cell.colour = colour
        return cell


# --- text output: nothing the database or a receiver wrote reaches the terminal raw --------


class Control(str):
    """The command's own terminal control (clearing the screen, going back to redraw a line of
    progress): the one part of a line that echo() writes as it is."""


# Printable ASCII needs no look: anything else is looked at one character at a time.
_MAYBE_HIDDEN = re.compile(r"[^ -~]")


def _escaped(match: re.Match[str]) -> str:
    char = match.group()
    # What str.isprintable() refuses, but for spaces: controls (C0, DEL, C1: escape sequences,
    # a carriage return that overwrites a line, a newline that forges one), format characters
    # (bidi overrides that reorder what follows, zero-width characters), line and paragraph
    # separators, surrogates, private and unassigned code points.
    if char.isprintable() or unicodedata.category(char) == "Zs":
        return char
    return char.encode("unicode_escape").decode("ascii")  # \x1b, \n, \u202e, \U000e0041


def printable(text: str, limit: int | None = None) -> str:
    r"""``text`` with every character a terminal would act on or not show written as its
    escape, as Python writes it (``\x1b``, ``\n``, ``\u202e``), so that nothing is hidden;
    other text, whatever its script, stays as it is. Backslashes are left alone: the text
    reads as it was, and the result holds no control character whatever the input (escaping
    it again changes nothing). With ``limit``: at most that many characters, cut with "…"
    between whole characters (never inside an escape)."""
    shown = _MAYBE_HIDDEN.sub(_escaped, text)
    if limit is None or len(shown) <= limit:
        return shown
    kept: list[str] = []
    room = limit - 1  # for the "…"
    for char in text:
        piece = _MAYBE_HIDDEN.sub(_escaped, char)
        room -= len(piece)
        if room < 0:
            break
        kept.append(piece)
    return "".join(kept) + "…"


def _shown(part: str) -> str:
    if isinstance(part, Control):
        return part
    text = printable(part)
    return paint(text, part.colour) if isinstance(part, Tint) else text


def echo(*parts: str, err: bool = False, nl: bool = True, color: bool | None = None) -> None:
    """Write one line of text output (on stderr with ``err``): every part escaped by
    printable(), a Tint part then painted in its colour, a Control part as it is. Every
    command writes its text through this (or echo_lines, print_table, confirm), so that text
    from the database, from a receiver or from the command line cannot drive the terminal."""
    click.echo("".join(map(_shown, parts)), err=err, nl=nl, color=color)


def echo_exact(text: str) -> None:
    """Output meant for another program (SQL for psql), which, like JSON, must be exactly
    what it says: not escaped. Only the commands' own text and names the operator gave."""
    click.echo(text)


def echo_lines(text: str, *, err: bool = False) -> None:
    """A text of several lines written by the program (a configuration's problems, a
    traceback): each line escaped on its own, so that its line breaks stay."""
    for line in text.split("\n"):
        echo(line, err=err)


def confirm(question: str) -> None:
    """Ask ``question`` (escaped) on the terminal; abort unless the answer is yes."""
    click.confirm(printable(question), abort=True, err=True)


def print_table(rows: Sequence[Sequence[str]], *, indent: str = "", numbers: bool = False) -> None:
    """Columns aligned to the left (with ``numbers``, all but the first to the right), the
    last as it is (free text). Each cell is measured as it is printed, escaped; a Tint cell is
    painted, its padding left plain."""
    shown = [[printable(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in shown) for i in range(len(rows[0]) - 1)]
    for cells, texts in zip(rows, shown, strict=True):
        line = [indent]
        for i, (cell, text) in enumerate(zip(cells, texts, strict=True)):
            tinted = paint(text, cell.colour) if isinstance(cell, Tint) else text
            if i == len(widths):
                line.append(tinted)
                break
            pad = " " * (widths[i] - len(text))
            line += [pad, tinted, "  "] if numbers and i else [tinted, pad, "  "]
        click.echo("".join(line))


def line(text: str | None, limit: int) -> str:
    """Free text on one line, at most ``limit`` characters: its line breaks and other
    controls shown escaped (``\\n``), as everything printed is; "-" if there is none."""
    return printable(text, limit) if text else "-"


def print_fields(fields: Mapping[str, str], width: int) -> None:
    """One ``name: value`` line per field, the values aligned after ``width`` characters (a
    Tint value painted)."""
    for k, v in fields.items():
        echo(f"{k + ':':<{width}} ", v)


# --- confirmations ----------------------------------------------------------------------------

# The destinations a refusal names on its one line; the question on a terminal lists them all.
REFUSAL_DESTINATIONS = 10


def confirm_change(summary: str, lines: list[str], action: str, *, empty: bool) -> None:
    """Show what a command is about to change (``summary``: what it would do, from its dry
    run; ``lines``: per destination) and ask ``action?`` on the terminal. Off a terminal it
    refuses (exit 2): --yes is the answer there. With nothing to change there is no question."""
    if not terminal.stdin():
        named = [x.strip() for x in lines[:REFUSAL_DESTINATIONS]]
        if len(lines) > REFUSAL_DESTINATIONS:
            named.append(f"… {len(lines) - REFUSAL_DESTINATIONS} more destination(s)")
        detail = f" ({'; '.join(named)})" if named else ""
        raise click.UsageError(
            f"{summary}{detail} and there is no terminal to confirm on: pass --yes to "
            f"{action} (--dry-run shows them and changes nothing)"
        )
    if empty:
        return  # nothing to do: the command says so
    echo(f"{summary}:", err=True)
    for text in lines:
        echo(text, err=True)
    confirm(f"{action}?")


# --- progress on the terminal -------------------------------------------------------------

# A line of progress is redrawn at most this often (seconds); an action says how long it has
# run once it has run this long.
REDRAW = 0.1
ELAPSED_AFTER = 1.0


class ProgressLine:
    """One line on stderr, redrawn in place while a command works (a purge's rows so far, a
    retry's time), and wiped when it is done. Only when stderr is a terminal and `shown`:
    elsewhere, and with --json, it writes nothing."""

    def __init__(self, shown: bool = True) -> None:
        self.shown = shown and terminal.stderr()
        self._drawn = 0  # characters on the line
        self._text = ""
        self._at = 0.0

    def draw(self, text: str, *, now: bool = False) -> None:
        """Show ``text`` instead of the line before, unless one was drawn in the last REDRAW
        seconds (``now``: all the same)."""
        if not self.shown or text == self._text:
            return
        if not (now or time.monotonic() - self._at >= REDRAW):
            return
        self._at = time.monotonic()
        self._text = text
        echo(Control("\r"), text.ljust(self._drawn), err=True, nl=False)
        self._drawn = len(text)

    def wipe(self) -> None:
        if self._drawn:
            echo(Control("\r"), " " * self._drawn, Control("\r"), err=True, nl=False)
            self._drawn = 0
            self._text = ""


def timed(
    label: str, action: Callable[[asyncpg.Connection], Awaitable[T]], *, shown: bool
) -> Callable[[asyncpg.Connection], Awaitable[T]]:
    """``action``, which is one statement with no progress to tell, saying on the terminal
    ``label… 3s`` once it has run ELAPSED_AFTER seconds: so a long one does not look hung."""

    async def run(conn: asyncpg.Connection) -> T:
        progress = ProgressLine(shown)
        if not progress.shown:
            return await action(conn)

        async def tick() -> None:
            start = time.monotonic()
            await asyncio.sleep(ELAPSED_AFTER)
            while True:
                progress.draw(f"{label}… {time.monotonic() - start:.0f}s", now=True)
                await asyncio.sleep(1)

        ticking = asyncio.create_task(tick())
        try:
            return await action(conn)
        finally:
            ticking.cancel()
            progress.wipe()

    return run
