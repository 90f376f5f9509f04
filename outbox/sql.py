"""Named statements read from ``.sql`` files: each domain's SQL lives in a file beside the code
that runs it (docs/development.md, "Where statements live"), and its module loads it once.

Here in the library rather than in the relay because both use it: the relay's statements and,
next, the library's own (outbox/queries.py); outbox never imports relay, relay may import
outbox. A file is a list of statements, each under its name, in the style of procrastinate and
River::

    -- name: pause
    -- Why it is written so: the comment lines right under the name document the statement
    -- (which index it uses, which test holds its plan); they are never sent.

    INSERT INTO {paused} (destination, paused_by, reason)
    ...

A statement's text is its lines, up to the next ``-- name:`` line or the end of the file,
blank lines at its end left out. Written after a blank line (as above) its text starts and
ends with a newline, as the triple-quoted Python string it was held; written right under the
name or the comments it is the bare text (``-- name: server_now`` then ``SELECT now()``). So
the text is byte for byte what the statement was in Python, what PostgreSQL receives and
prepares. Placeholders (``{table}``, ``$1``) are left as written: the statements are asyncpg's
(``$n`` binds), and the render functions fill in the tables (relay.db.queries.render_ops).
Before the first name a file may hold only ``--`` comments and blank lines (its header).
"""

from __future__ import annotations

import functools
import re
from collections.abc import Iterator, Mapping
from importlib import resources

NAME = re.compile(r"-- name: (?P<name>[a-z][a-z0-9_]*)\s*$")


class SqlFileError(ValueError):
    """A ``.sql`` file of statements that cannot be read as one: the message says where."""


class Statements(Mapping[str, str]):
    """The statements of one file by name; a name it lacks is an error naming the file."""

    def __init__(self, where: str, statements: dict[str, str]) -> None:
        self.where = where
        self._statements = statements

    def __getitem__(self, name: str) -> str:
        try:
            return self._statements[name]
        except KeyError:
            known = ", ".join(sorted(self._statements))
            raise KeyError(f"{self.where} has no statement {name!r} (it has: {known})") from None

    def __iter__(self) -> Iterator[str]:
        return iter(self._statements)

    def __len__(self) -> int:
        return len(self._statements)


@functools.cache
def load(package: str, filename: str) -> Statements:
    """The statements of ``filename`` in ``package`` (``load("relay.ops", "queries.sql")``),
    read and parsed once per file; through importlib.resources, so an installed wheel's are
    found as the checkout's."""
    # utf-8-sig: a file an editor saved with a byte order mark reads as without it.
    text = resources.files(package).joinpath(filename).read_text(encoding="utf-8-sig")
    return Statements(f"{package.replace('.', '/')}/{filename}", parse(text, filename))


def parse(text: str, where: str = "<sql>") -> dict[str, str]:
    """The statements of a file's ``text`` by name, in file order (see the module's docstring
    for the format); ``where`` names the file in errors."""
    # Lines end at "\n" alone: splitlines() would also cut at a form feed or U+2028 inside a
    # string literal, and the text would no longer be the statement's, byte for byte.
    lines = text.replace("\r\n", "\n").split("\n")
    starts = [i for i, line in enumerate(lines) if line.startswith("-- name:")]
    if not starts:
        raise SqlFileError(f"{where}: no statement (each begins with a '-- name:' line)")
    for i in range(starts[0] if starts else len(lines)):
        if lines[i].strip() and not lines[i].startswith("--"):
            raise SqlFileError(f"{where}:{i + 1}: SQL before the first '-- name:' line")
    found: dict[str, str] = {}
    first_at: dict[str, int] = {}
    for start, end in zip(starts, [*starts[1:], len(lines)], strict=True):
        match = NAME.match(lines[start])
        if match is None:
            raise SqlFileError(
                f"{where}:{start + 1}: a name is '-- name: ' then lower-case letters, digits "
                f"and underscores: {lines[start]!r}"
            )
        name = match["name"]
        if name in found:
            raise SqlFileError(
                f"{where}:{start + 1}: statement {name!r} is named twice "
                f"(first at line {first_at[name]})"
            )
        found[name] = _statement(lines[start + 1 : end], f"{where}:{start + 1}", name)
        first_at[name] = start + 1
    return found


def _statement(lines: list[str], where: str, name: str) -> str:
    """The text of a statement from the lines under its name: the comment lines first, then
    the statement (after a blank line: between newlines)."""
    body = 0
    while body < len(lines) and lines[body].startswith("--"):
        body += 1
    wrapped = body < len(lines) and not lines[body].strip()
    end = len(lines)
    while end > body and not lines[end - 1].strip():
        end -= 1
    if wrapped:
        body += 1
    if end <= body:
        raise SqlFileError(f"{where}: statement {name!r} has no text")
    if lines[end - 1].startswith("--"):
        # It would be sent as the statement's last line, and whatever follows the text (a
        # ";" appended) would be inside the comment.
        raise SqlFileError(
            f"{where}: comment lines after statement {name!r}: put them under the name of the "
            "statement they explain"
        )
    text = "\n".join(lines[body:end])
    return f"\n{text}\n" if wrapped else text
