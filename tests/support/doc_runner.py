"""A Markdown page done as it says (tests/support/markdown.py): its files written, its run
blocks run in order in one working folder against the real services (the `outbox-relay` and
Python of this checkout), their output compared with the output the page shows, and its
fragments checked without running them (tests/support/doc_checks.py)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path

from tests.support import doc_checks
from tests.support.markdown import Block, blocks

ROOT = Path(__file__).resolve().parent.parent.parent
# The languages whose every block a page must mark: run, written to a file, or a fragment.
CHECKED = {"python", "py", "toml", "sh", "bash", "shell", "console"}
SHELLS = {"sh", "bash", "shell", "console"}


def unmarked(page: Path) -> list[str]:
    return [
        f"{page.name}:{b.line}: a {b.lang} block with no <!-- run -->, <!-- file: PATH --> or "
        "<!-- fragment --> before it"
        for b in blocks(page)
        if b.lang in CHECKED and b.directive is None
    ]


def check_fragment(page: Path, b: Block, workdir: Path) -> list[str]:
    where = f"{page.name}:{b.line}"
    if b.lang in ("python", "py"):
        return doc_checks.check_python(b.code, where)
    if b.lang == "toml":
        return doc_checks.check_toml(b.code, where, workdir)
    if b.lang in SHELLS:
        return doc_checks.check_shell(b.code, where, console=b.lang == "console")
    return []


def run_page(
    page: Path, workdir: Path, db_url: str, env: Mapping[str, str] | None = None
) -> list[tuple[Block, str]]:
    """Every block of ``page`` done as it says, in ``workdir``; each run block with its output.
    Raises AssertionError naming the block that failed, printed something else, or is a
    fragment that names what does not exist."""
    full = {
        **os.environ,
        "DATABASE_URL": db_url,
        "PYTHONPATH": str(workdir) + os.pathsep + str(ROOT),
        "PATH": str(Path(sys.executable).parent) + os.pathsep + os.environ["PATH"],
        **(env or {}),
    }
    full.pop("OUTBOX_CATALOG_SOURCE", None)
    done: list[tuple[Block, str]] = []
    problems = unmarked(page)
    for b in blocks(page):
        if b.file is not None:
            target = workdir / b.file
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(b.code)
            if b.lang in ("python", "py", "toml"):
                problems += check_fragment(page, b, workdir)
        elif b.directive == "fragment":
            problems += check_fragment(page, b, workdir)
        elif b.directive == "fragment: syntax":
            problems += doc_checks.check_syntax(b.lang, b.code, f"{page.name}:{b.line}")
        elif b.directive == "run":
            done.append((b, _run(page, b, workdir, full)))
        elif b.directive == "output":
            assert done, f"{page.name}:{b.line}: an output block with no run before it"
            assert printed(b.code, done[-1][1]), (
                f"{page.name}:{b.line}: the example printed\n{done[-1][1]}"
            )
    assert not problems, "\n".join(problems)
    return done


def printed(shown: str, out: str) -> bool:
    """Whether ``out`` is what the page shows: line for line, where a line `…` alone stands
    for any lines, none included (what differs from one run to the next: which migrations a
    database already had)."""
    pattern = "".join(
        r"(?:.*\n)*?" if line == "…" else re.escape(line) + r"\n" for line in shown.splitlines()
    )
    return re.fullmatch(pattern, out) is not None


def _run(page: Path, b: Block, workdir: Path, env: Mapping[str, str]) -> str:
    argv = (
        [sys.executable, "-c", b.code]
        if b.lang in ("python", "py")
        else ["bash", "-euo", "pipefail", "-c", b.code]
    )
    res = subprocess.run(argv, cwd=workdir, env=env, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, (
        f"{page.name}:{b.line} exited {res.returncode}:\n{res.stdout}{res.stderr}"
    )
    return res.stdout
