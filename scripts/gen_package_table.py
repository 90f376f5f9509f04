"""Writes the table of packages in docs/architecture.md ("The house") from their docstrings.

Each package of `outbox/` and `relay/`, and each module at the top of `relay/`, is one row:
its path and the first sentence of its docstring. A package or module without a docstring
stops the script: say what it holds where it is defined.

    .venv/bin/python scripts/gen_package_table.py           # rewrite the table
    .venv/bin/python scripts/gen_package_table.py --check   # exit 1, with a diff, if it differs
"""

from __future__ import annotations

import argparse
import ast
import difflib
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "architecture.md"
BEGIN = "<!-- package table: scripts/gen_package_table.py writes it -->"
END = "<!-- end of the package table -->"
SKIP = {"outbox/django/management", "outbox/django/management/commands"}


def places() -> list[Path]:
    """The packages (their __init__.py) and relay's top-level modules, in tree order."""
    found = [p for p in sorted(ROOT.glob("outbox/**/__init__.py"))]
    found += sorted(ROOT.glob("relay/**/__init__.py"))
    found += sorted(p for p in (ROOT / "relay").glob("*.py") if p.name != "__init__.py")
    rel = [p for p in found if str(p.parent.relative_to(ROOT)) not in SKIP]
    return sorted(rel, key=lambda p: _name(p))


def _name(p: Path) -> str:
    rel = p.relative_to(ROOT)
    return f"{rel.parent}/" if p.name == "__init__.py" else str(rel)


def first_sentence(text: str) -> str:
    paragraph = text.strip().split("\n\n")[0]
    flat = re.sub(r":\w+:`", "`", " ".join(paragraph.split()).replace("``", "`"))
    m = re.match(r"(.+?\.)(\s+[A-Z(`]|$)", flat)
    return (m.group(1) if m else flat).rstrip(".") + "."


def table() -> str:
    rows, missing = [], []
    for p in places():
        doc = ast.get_docstring(ast.parse(p.read_text()))
        if not doc:
            missing.append(_name(p))
            continue
        rows.append(f"| `{_name(p)}` | {first_sentence(doc).replace('|', '/')} |")
    if missing:
        sys.exit("no docstring in: " + ", ".join(missing))
    return "\n".join(["| where | what it holds |", "|---|---|", *rows])


def render(doc: str) -> str:
    head, _, rest = doc.partition(BEGIN)
    _, _, tail = rest.partition(END)
    if not rest or END not in rest:
        sys.exit(f"{DOC} has no {BEGIN} … {END} block")
    return f"{head}{BEGIN}\n{table()}\n{END}{tail}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if the table differs")
    args = parser.parse_args()
    now = DOC.read_text()
    new = render(now)
    if args.check:
        if new != now:
            sys.stdout.writelines(difflib.unified_diff(now.splitlines(True), new.splitlines(True)))
            return 1
        return 0
    DOC.write_text(new)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
