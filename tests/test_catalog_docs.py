"""docs/catalog.md runs as it is written: its files written, its Python and shell examples run
in order against a real database (the `outbox-relay` of this checkout), their output compared
with the output the page shows. A broken example fails here."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.doc_runner import run_page

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "catalog.md"


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
