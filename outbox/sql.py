"""Named statements read from ``.sql`` files: each domain's SQL lives in a file beside the code
that runs it (docs/development.md, "Where statements live"), and its module loads it once.

Here in the library rather than in the relay because both use it: the relay's statements and
the library's own (outbox/queries.py); outbox never imports relay, relay may import
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
prepares. Before the first name a file may hold only ``--`` comments and blank lines (its
header).

Values are binds written one way in every file, ``:name``, and each statement that has any
declares them in a comment line under its name, in the order its caller passes them::

    -- name: resume
    -- params: destination
    DELETE FROM {paused} WHERE destination = :destination RETURNING paused_at

The relay's statements, and the library's for asyncpg connections, run on asyncpg, which binds
``$1``, ``$2``, …: they are loaded with ``binds="numbered"``, each ``:name`` handed out as its
place in the params line (the text above becomes ``… WHERE destination = $1 …``). Statements
run through SQLAlchemy's text() (the library's enqueue, endpoints API and inbox for SQLAlchemy
sessions, the demo's), which binds ``:name`` itself: ``binds="named"`` leaves them as written
(and refuses ``:name::type``, which text() would not read as a bind: ``CAST(:name AS type)`` is
read by both). A bind used but not declared, declared but not used, or a ``$1`` written in a
file is an error naming the statement. Tables are placeholders (``{table}``), filled in by the
render functions (relay.db.queries.render_ops): identifiers are never binds.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Iterator, Mapping
from importlib import resources
from typing import Literal

NAME = re.compile(r"-- name: (?P<name>[a-z][a-z0-9_]*)\s*$")
PARAMS = re.compile(r"-- params:(?P<names>.*)$")
PARAM_NAME = re.compile(r"[a-z][a-z0-9_]*")

Binds = Literal["numbered", "named"]
"""How a file's ``:name`` binds are handed out: ``numbered`` as asyncpg's ``$1``, ``$2``, … in
the order the statement's ``-- params:`` line gives (the relay's statements); ``named`` as
written, for SQLAlchemy's text() (the library's)."""

# What in a statement's text is not a bind although it may look like one: comments (block
# comments nest, as PostgreSQL reads them: _block_end finds where one ends), string literals
# (E'…' with backslash escapes), quoted identifiers, dollar-quoted bodies; and what is one:
# ``:name`` not after a word character, a backslash or another colon (SQLAlchemy's rule),
# ``::`` being a cast. ``$1`` is found to be refused: one style in every file. A ``$`` after an
# identifier's character is part of it (``col$1``), neither a bind nor a dollar quote.
_TOKEN = re.compile(
    r"""
    (?P<comment>--[^\n]*)
  | (?P<block>/\*)
  | (?P<string>(?<!\w)[eE]'(?:[^'\\]|\\.|'')*'|'(?:[^']|'')*')
  | (?P<ident>"(?:[^"]|"")*")
  | (?<![\w$])(?P<dollar>\$(?P<tag>(?:[A-Za-z_][A-Za-z0-9_]*)?)\$.*?\$(?P=tag)\$)
  | (?<![\w$])(?P<numbered>\$[0-9]+)
  | (?P<cast>::)
  | (?<![\w\\:]):(?P<bind>[A-Za-z_][A-Za-z0-9_]*)
    """,
    re.S | re.X,
)
_BLOCK = re.compile(r"/\*|\*/")

# How SQLAlchemy's text() finds binds (sqlalchemy.sql.elements.TextClause._bind_params_regex):
# anywhere in the text, strings and comments included.
_TEXT_BIND = re.compile(r"(?<![:\w\x5c]):(\w+)(?![:\w])", re.UNICODE)


def _block_end(text: str, start: int) -> int:
    """Where the block comment opened at ``start`` ends: after the ``*/`` that closes it, the
    ones nested in it closed first (or the end of the text, which PostgreSQL refuses)."""
    depth = 0
    for mark in _BLOCK.finditer(text, start):
        depth += 1 if mark.group() == "/*" else -1
        if depth == 0:
            return mark.end()
    return len(text)


def _tokens(text: str) -> Iterator[re.Match[str]]:
    """The tokens of ``text`` that matter to its binds, a block comment (nested ones in it)
    passed over whole."""
    at = 0
    while (token := _TOKEN.search(text, at)) is not None:
        if token["block"] is not None:
            at = _block_end(text, token.start())
            continue
        yield token
        at = token.end()


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
def load(package: str, filename: str, *, binds: Binds) -> Statements:
    """The statements of ``filename`` in ``package`` (``load("relay.ops", "queries.sql",
    binds="numbered")``), read and parsed once per file; through importlib.resources, so an
    installed wheel's are found as the checkout's."""
    # utf-8-sig: a file an editor saved with a byte order mark reads as without it.
    text = resources.files(package).joinpath(filename).read_text(encoding="utf-8-sig")
    return Statements(f"{package.replace('.', '/')}/{filename}", parse(text, filename, binds))


def parse(text: str, where: str = "<sql>", binds: Binds = "numbered") -> dict[str, str]:
    """The statements of a file's ``text`` by name, in file order, their binds handed out as
    ``binds`` says (see the module's docstring for the format); ``where`` names the file in
    errors."""
    # Lines end at "\n" alone: splitlines() would also cut at a form feed or U+2028 inside a
    # string literal, and the text would no longer be the statement's, byte for byte.
    lines = text.replace("\r\n", "\n").split("\n")
    starts = [i for i, line in enumerate(lines) if line.startswith("-- name:")]
    if not starts:
        raise SqlFileError(f"{where}: no statement (each begins with a '-- name:' line)")
    for i in range(starts[0]):
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
        here = f"{where}:{start + 1}"
        params, text_ = _statement(lines[start + 1 : end], here, name)
        found[name] = bind(text_, params, binds, f"{here}: statement {name!r}")
        first_at[name] = start + 1
    return found


def _statement(lines: list[str], where: str, name: str) -> tuple[list[str] | None, str]:
    """The declared parameters (its ``-- params:`` line, if any) and the text of a statement
    from the lines under its name: the comment lines first, then the statement (after a blank
    line: between newlines)."""
    body = 0
    params: list[str] | None = None
    while body < len(lines) and lines[body].startswith("--"):
        declared = PARAMS.match(lines[body])
        if declared is not None:
            if params is not None:
                raise SqlFileError(f"{where}: statement {name!r} has two '-- params:' lines")
            params = _param_names(declared["names"], where, name)
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
    return params, f"\n{text}\n" if wrapped else text


def _param_names(line: str, where: str, name: str) -> list[str]:
    names = [part.strip() for part in line.split(",")]
    for part in names:
        if not PARAM_NAME.fullmatch(part):
            raise SqlFileError(
                f"{where}: statement {name!r}: {part!r} in its '-- params:' line is not a "
                "name (lower-case letters, digits and underscores, comma-separated)"
            )
    twice = sorted({part for part in names if names.count(part) > 1})
    if twice:
        raise SqlFileError(f"{where}: statement {name!r} declares {', '.join(twice)} twice")
    return names


def bind(text: str, params: list[str] | None, binds: Binds, where: str = "<sql>") -> str:
    """``text`` with its ``:name`` binds handed out as ``binds`` says: as ``$n`` in the order of
    ``params`` (its ``-- params:`` line), or as written. Every bind must be declared and every
    declared name used, so the order the caller passes values in is the one written down."""
    used: list[tuple[int, int, str]] = []
    for token in _tokens(text):
        if token["numbered"] is not None:
            raise SqlFileError(
                f"{where}: {token['numbered']} is a numbered bind; write it as :name and "
                "declare the order in its '-- params:' line"
            )
        name = token["bind"]
        if name is None:
            continue
        if binds == "named" and text.startswith("::", token.end()):
            # SQLAlchemy's text() reads ":name::type" as no bind at all.
            raise SqlFileError(
                f"{where}: :{name}:: is not a bind for SQLAlchemy; write CAST(:{name} AS …)"
            )
        used.append((token.start(), token.end(), name))
    declared = params or []
    unknown = sorted({name for _, _, name in used} - set(declared))
    if unknown:
        raise SqlFileError(
            f"{where} uses {', '.join(':' + n for n in unknown)} without declaring it in its "
            "'-- params:' line"
        )
    unused = [name for name in declared if name not in {n for _, _, n in used}]
    if unused:
        raise SqlFileError(
            f"{where} declares {', '.join(unused)} in its '-- params:' line but never uses it"
        )
    if binds == "named":
        _check_as_text_reads(text, {start: name for start, _, name in used}, where)
        return text
    out: list[str] = []
    at = 0
    for start, end, name in used:
        out.append(text[at:start])
        out.append(f"${declared.index(name) + 1}")
        at = end
    out.append(text[at:])
    return "".join(out)


def _check_as_text_reads(text: str, binds_at: dict[int, str], where: str) -> None:
    """Refuse a named statement that SQLAlchemy's text() would read otherwise than the loader:
    it takes a ``:name`` in a string literal or a comment for a bind too, reads none where a
    colon follows (``[:lo: :hi]``), and reads a name on through any letter (``:idé``). The
    statement, loaded without an error, would fail when run."""
    read = {found.start(): found[1] for found in _TEXT_BIND.finditer(text)}
    for start, name in read.items():
        if start not in binds_at:
            raise SqlFileError(
                f"{where}: SQLAlchemy's text() reads :{name} as a bind (it does inside "
                "strings and comments too): write it without the colon, or bind the value"
            )
    for start, name in binds_at.items():
        if read.get(start) != name:
            raise SqlFileError(
                f"{where}: SQLAlchemy's text() does not read :{name} as the bind {name!r} "
                "(a colon or a letter right after it): put a space or a cast after it"
            )
