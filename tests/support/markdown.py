"""The code blocks of a Markdown page and what the page says to do with each: an HTML comment on
the line before a block, `<!-- file: PATH -->` (write it there), `<!-- run -->` (run it) or
`<!-- output -->` (what the run before it prints) or `<!-- fragment -->` (shown only, checked as
far as it can be without running it: tests/support/doc_checks.py; `<!-- fragment: syntax -->`
for one that names what only its reader has, a file of theirs: checked only to parse). The page
stays the source: tests run what readers read.

A block is every fenced block a reader sees (CommonMark's rules, as far as pages use them):
opened by three or more backticks or tildes, indented or not (a block in a list item), closed
by a fence of the same character at least as long, or by the end of the page; its language is
the first word of the fence's info, in lower case (GitHub highlights ```Python as Python)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

_DIRECTIVE = re.compile(r"^\s*<!--\s*(file:\s*\S+|run|output|fragment(?::\s*syntax)?)\s*-->\s*$")
# A comment alone on its line that reads like a directive (one or two words, maybe a colon and
# a path): a misspelt one would leave its block unmarked, or an output compared with nothing.
_LIKE_DIRECTIVE = re.compile(r"^\s*<!--\s*[\w-]+(?::\s*\S*)?\s*-->\s*$")
_OPEN = re.compile(r"^(?P<indent> *)(?P<fence>`{3,}|~{3,})(?P<info>.*)$")


@dataclass(frozen=True)
class Block:
    lang: str
    directive: str | None  # "run", "output", "fragment", "file: PATH" or None (unmarked)
    code: str
    line: int  # where the block starts in the page, for messages

    @property
    def file(self) -> str | None:
        if self.directive and self.directive.startswith("file:"):
            return self.directive.removeprefix("file:").strip()
        return None


def blocks(page: Path) -> list[Block]:
    return parse(page.read_text(encoding="utf-8"))[0]


def stray_directives(page: Path) -> list[str]:
    """Directive-like comments that mark no block: one parted from its block by a blank line,
    or one the suite does not know (`<!-- ouptut -->`)."""
    return [f"{page.name}:{n}: {text}" for n, text in parse(page.read_text(encoding="utf-8"))[1]]


def parse(text: str) -> tuple[list[Block], list[tuple[int, str]]]:
    """The page's blocks, and the directive-like comments that mark none (line, problem)."""
    lines = text.splitlines()
    found: list[Block] = []
    taken: set[int] = set()  # the lines of blocks and of the directives that mark them
    i = 0
    while i < len(lines):
        m = _OPEN.match(lines[i])
        if m is None or (m["fence"][0] == "`" and "`" in m["info"]):
            i += 1
            continue
        end = _close(lines, i + 1, m["fence"])
        indent = len(m["indent"])
        code = "".join(_dedent(line, indent) + "\n" for line in lines[i + 1 : end])
        before = _DIRECTIVE.match(lines[i - 1]) if i else None
        directive = re.sub(r"\s+", " ", before[1]) if before else None
        lang = m["info"].strip().lstrip("{.").split(" ")[0].rstrip("}").lower()
        found.append(Block(lang, directive, code, i + 2))
        taken.update(range(i - (1 if before else 0), end + 1))
        i = end + 1
    return found, _stray(lines, taken)


def _stray(lines: list[str], taken: set[int]) -> list[tuple[int, str]]:
    stray: list[tuple[int, str]] = []
    for n, line in enumerate(lines):
        if n in taken:
            continue
        if _DIRECTIVE.match(line):
            stray.append((n + 1, f"{line.strip()} marks no block: put it on the line before one"))
        elif _LIKE_DIRECTIVE.match(line) and n + 1 < len(lines) and _OPEN.match(lines[n + 1]):
            stray.append((n + 1, f"{line.strip()} marks no block: not a directive of the suite"))
    return stray


def _close(lines: list[str], start: int, fence: str) -> int:
    """The line of the fence that closes a block opened by ``fence``, or the page's end."""
    closing = re.compile(rf"^ *{re.escape(fence[0])}{{{len(fence)},}}\s*$")
    for n in range(start, len(lines)):
        if closing.match(lines[n]):
            return n
    return len(lines)


def _dedent(line: str, indent: int) -> str:
    """A line of a block less the fence's indentation (CommonMark: as much of it as it has)."""
    strip = len(line) - len(line.lstrip(" "))
    return line[min(strip, indent) :]
