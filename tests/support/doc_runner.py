"""A Markdown page done as it says (tests/support/markdown.py): its files written, its run
blocks run in order in one working folder against the real services (the `outbox-relay` and
Python of this checkout), their output compared with the output the page shows, and its
fragments checked without running them (tests/support/doc_checks.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path

from tests.support import doc_checks
from tests.support.markdown import Block, blocks, stray_directives

ROOT = Path(__file__).resolve().parent.parent.parent
# The names GitHub highlights each language by (in lower case, as markdown.py gives them).
PYTHON = {"python", "py", "python3", "py3"}
# Shell sessions: commands after a `$ ` prompt, the rest their output.
SESSIONS = {"console", "shell-session", "shellsession", "sh-session"}
SHELLS = {"sh", "bash", "shell", "zsh", *SESSIONS}
# The languages whose every block a page must mark: run, written to a file, or a fragment.
CHECKED = {*PYTHON, "pycon", "toml", *SHELLS}


def unmarked(page: Path) -> list[str]:
    return [
        f"{page.name}:{b.line}: a {b.lang} block with no <!-- run -->, <!-- file: PATH --> or "
        "<!-- fragment --> before it"
        for b in blocks(page)
        if b.lang in CHECKED and b.directive is None
    ] + stray_directives(page)


def check_fragment(page: Path, b: Block, workdir: Path) -> list[str]:
    where = f"{page.name}:{b.line}"
    if b.lang in PYTHON:
        return doc_checks.check_python(b.code, where)
    if b.lang == "pycon":  # an interpreter session: the code after its prompts
        code = "".join(
            line[4:] + "\n" for line in b.code.splitlines() if line[:4] in (">>> ", "... ")
        )
        return doc_checks.check_python(code, where)
    if b.lang == "toml":
        return doc_checks.check_toml(b.code, where, workdir)
    if b.lang in SHELLS:
        return doc_checks.check_shell(b.code, where, console=b.lang in SESSIONS)
    return []


def run_page(
    page: Path, workdir: Path, db_url: str, env: Mapping[str, str] | None = None
) -> list[tuple[Block, str]]:
    """Every block of ``page`` done as it says, in ``workdir``; each run block with its output.
    Raises AssertionError naming the block that failed, printed something else, or is a
    fragment that names what does not exist."""
    full = environment(workdir, db_url, env)
    done: list[tuple[Block, str]] = []
    problems = unmarked(page)
    for b in blocks(page):
        if b.file is not None:
            target = workdir / b.file
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(b.code)
            problems += check_fragment(page, b, workdir)
        elif b.directive == "fragment":
            problems += check_fragment(page, b, workdir)
        elif b.directive == "fragment: syntax":
            lang = "python" if b.lang in PYTHON else "sh" if b.lang in SHELLS else b.lang
            problems += doc_checks.check_syntax(lang, b.code, f"{page.name}:{b.line}")
        elif b.directive == "run":
            done.append((b, _run(page, b, workdir, full)))
        elif b.directive == "output":
            assert done, f"{page.name}:{b.line}: an output block with no run before it"
            assert printed(b.code, done[-1][1]), (
                f"{page.name}:{b.line}: the example printed\n{done[-1][1]}"
            )
    assert not problems, "\n".join(problems)
    return done


def environment(workdir: Path, db_url: str, env: Mapping[str, str] | None = None) -> dict[str, str]:
    """What a page's commands run with: this checkout's `python` and `outbox-relay` first on
    the `PATH`, the page's folder and this checkout importable, `DATABASE_URL`, and ``env``."""
    # Not the caller's OUTBOX_* settings: the environment wins over a page's file and flags,
    # so a developer's OUTBOX_SCHEMA or OUTBOX_DATABASE_URL would change what the page does.
    return {
        **{k: v for k, v in os.environ.items() if not k.startswith("OUTBOX_")},
        "DATABASE_URL": db_url,
        "PYTHONPATH": str(workdir) + os.pathsep + str(ROOT),
        "PATH": str(Path(sys.executable).parent) + os.pathsep + os.environ["PATH"],
        **(env or {}),
    }


def printed(shown: str, out: str) -> bool:
    """Whether ``out`` is what the page shows: line for line, where a line `…` alone stands
    for any lines, none included (what differs from one run to the next: which migrations a
    database already had)."""
    if out and not out.endswith("\n"):
        return False  # every line shown ends with one
    lines = out.removesuffix("\n").split("\n") if out else []
    # The runs of lines between the ellipses, each found at the first place it fits after
    # the one before: a glob's match, in linear time (a regular expression of `(?:.*\n)*?`
    # per ellipsis backtracks through every split of the output).
    parts: list[list[str]] = [[]]
    for line in shown.removesuffix("\n").split("\n") if shown else []:
        if line == "…":
            parts.append([])
        else:
            parts[-1].append(line)
    if len(parts) == 1:
        return lines == parts[0]
    first, *middle, last = parts
    at, stop = len(first), len(lines) - len(last)
    if stop < at or lines[:at] != first or lines[stop:] != last:
        return False
    for part in middle:
        found = _find(lines, part, at, stop)
        if found is None:
            return False
        at = found + len(part)
    return True


def _find(lines: list[str], part: list[str], start: int, stop: int) -> int | None:
    for i in range(start, stop - len(part) + 1):
        if lines[i : i + len(part)] == part:
            return i
    return None


def _run(page: Path, b: Block, workdir: Path, env: Mapping[str, str]) -> str:
    argv = (
        [sys.executable, "-c", b.code]
        if b.lang in PYTHON
        else ["bash", "-euo", "pipefail", "-c", b.code]
    )
    res = subprocess.run(argv, cwd=workdir, env=env, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, (
        f"{page.name}:{b.line} exited {res.returncode}:\n{res.stdout}{res.stderr}"
    )
    return res.stdout


def broken_copy(
    page: Path, tmp_path: Path, old: str, new: str, count: int = -1
) -> tuple[Path, Path]:
    """``page`` broken on purpose, to show that the suite fails on it: ``old`` replaced by
    ``new`` (every time, or ``count`` times), written in ``tmp_path``; and an empty working
    folder beside it for the broken page's files."""
    text = page.read_text()
    assert old in text, f"{page.name} no longer shows {old!r}: pick another example to break"
    broken = tmp_path / page.name
    broken.write_text(text.replace(old, new, count))
    work = tmp_path / "work"
    work.mkdir()
    return broken, work
