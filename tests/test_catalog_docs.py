"""docs/catalog.md runs as it is written: its files written, its Python and shell examples run
in order against a real database (the `outbox-relay` of this checkout), their output compared
with the output the page shows. A broken example fails here."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.markdown import Block, blocks

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "catalog.md"


def run_page(page: Path, workdir: Path, db_url: str) -> list[tuple[Block, str]]:
    """Every block of ``page`` done as it says, in ``workdir``; each run block with its output.
    Raises AssertionError naming the block that failed or printed something else."""
    env = {
        **os.environ,
        "DATABASE_URL": db_url,
        "PYTHONPATH": str(workdir) + os.pathsep + str(ROOT),
        "PATH": str(Path(sys.executable).parent) + os.pathsep + os.environ["PATH"],
    }
    env.pop("OUTBOX_CATALOG_SOURCE", None)
    done: list[tuple[Block, str]] = []
    for b in blocks(page):
        if b.file is not None:
            target = workdir / b.file
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(b.code)
        elif b.directive == "run":
            argv = (
                [sys.executable, "-c", b.code]
                if b.lang == "python"
                else ["bash", "-euo", "pipefail", "-c", b.code]
            )
            res = subprocess.run(
                argv, cwd=workdir, env=env, capture_output=True, text=True, timeout=120
            )
            assert res.returncode == 0, (
                f"{page.name}:{b.line} exited {res.returncode}:\n{res.stdout}{res.stderr}"
            )
            done.append((b, res.stdout))
        elif b.directive == "output":
            assert done, f"{page.name}:{b.line}: an output block with no run before it"
            assert done[-1][1] == b.code, (
                f"{page.name}:{b.line}: the example printed\n{done[-1][1]}"
            )
    return done


def test_the_catalog_page_runs(db_url: str, tmp_path: Path) -> None:
    done = run_page(PAGE, tmp_path, db_url)
    assert [b.lang for b, _ in done] == ["python", "sh", "sh"]
    # What the examples claim happened, happened: one event stored (the refused one not), the
    # document written, the check against it clean.
    import psycopg

    with psycopg.connect(db_url) as c:
        rows = c.execute(
            "SELECT event_type, convert_from(payload, 'UTF8')::jsonb->>'currency' FROM outbox"
        ).fetchall()
    assert rows == [("order.created", "EUR")]
    assert '"asyncapi": "3.0.0"' in (tmp_path / "asyncapi.json").read_text()
    assert "no change against asyncapi.json" in done[-1][1]


def test_a_broken_example_fails(db_url: str, tmp_path: Path) -> None:
    broken = tmp_path / "catalog.md"
    broken.write_text(
        PAGE.read_text().replace("outbox.catalog.use(catalog)", "outbox.catalog.uses(catalog)")
    )
    with pytest.raises(AssertionError, match=r"catalog\.md:\d+ exited 1"):
        run_page(broken, tmp_path, db_url)
