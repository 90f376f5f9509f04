"""The code blocks of a Markdown page and what the page says to do with each: an HTML comment on
the line before a block, `<!-- file: PATH -->` (write it there), `<!-- run -->` (run it) or
`<!-- output -->` (what the run before it prints) or `<!-- fragment -->` (shown only, checked as
far as it can be without running it: tests/support/doc_checks.py; `<!-- fragment: syntax -->`
for one that names what only its reader has, a file of theirs: checked only to parse). The page
stays the source: tests run what readers read."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

_BLOCK = re.compile(
    r"(?:^<!--\s*(?P<directive>file:\s*\S+|run|output|fragment(?::\s*syntax)?)\s*-->\n)?"
    r"^```(?P<lang>[\w+-]*)[^\n]*\n(?P<code>.*?)^```\s*$",
    re.M | re.S,
)


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
    text = page.read_text(encoding="utf-8")
    return [
        Block(
            m["lang"],
            re.sub(r"\s+", " ", m["directive"]) if m["directive"] else None,
            m["code"],
            text.count("\n", 0, m.start("code")) + 1,
        )
        for m in _BLOCK.finditer(text)
    ]
