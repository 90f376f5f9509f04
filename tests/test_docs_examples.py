"""Every page's examples, as the page says: each Python, TOML and shell block of README.md and
docs/ is run against the real services (`<!-- run -->`, with its `<!-- output -->` compared),
written where a later run reads it (`<!-- file: PATH -->`), or marked a fragment and checked as
far as that goes without running it (what it imports and calls exists, its commands and their
options exist, its TOML is a configuration the relay accepts). A broken example fails here,
and so does an example nobody marked."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support import doc_checks
from tests.support.doc_runner import broken_copy, printed, run_page, unmarked
from tests.support.markdown import blocks

ROOT = Path(__file__).resolve().parent.parent
# Pages with a test of their own, which runs them and checks what their runs did.
OWN_TEST = {
    "docs/catalog.md": "tests/test_catalog_docs.py",
    "docs/cloudevents.md": "tests/test_cloudevents_docs.py",
    "docs/consumers.md": "tests/test_consumers_docs.py",
}
PAGES = sorted(
    p.relative_to(ROOT).as_posix()
    for p in [ROOT / "README.md", *(ROOT / "docs").rglob("*.md")]
    if p.relative_to(ROOT).as_posix() not in OWN_TEST
)


@pytest.mark.parametrize("page", PAGES)
def test_the_page_does_what_it_shows(
    page: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    path = ROOT / page
    runs = any(b.directive == "run" for b in blocks(path))
    # Only a page that runs something needs a database of its own.
    db_url = request.getfixturevalue("db_url") if runs else "postgresql://docs@localhost/unused"
    run_page(path, tmp_path, db_url)


def test_the_pages_with_a_test_of_their_own_have_one() -> None:
    for page, test in OWN_TEST.items():
        assert (ROOT / page).exists() and (ROOT / test).exists()
        assert page in (ROOT / test).read_text() or Path(page).name in (ROOT / test).read_text()


# --- the checks fail on what is broken ----------------------------------------------------------


def test_a_wrong_function_name_in_the_usage_page_fails(db_url: str, tmp_path: Path) -> None:
    usage = ROOT / "docs/usage.md"
    broken, work = broken_copy(usage, tmp_path, "outbox.enqueue(", "outbox.enqueue_one(", 1)
    # The page's run fails on it (the traceback names it), before its fragments are checked.
    with pytest.raises(AssertionError, match=r"(?s)usage\.md:\d+ exited 1:.*'enqueue_one'"):
        run_page(broken, work, db_url)


def test_a_wrong_function_name_in_a_fragment_fails(tmp_path: Path) -> None:
    readme = ROOT / "README.md"
    broken, work = broken_copy(readme, tmp_path, "outbox.enqueue(", "outbox.enqueue_one(", 1)
    with pytest.raises(
        AssertionError, match=r"README\.md:\d+: `outbox\.enqueue_one`: no such name"
    ):
        run_page(broken, work, "postgresql://docs@localhost/unused")


def test_a_broken_run_example_fails(db_url: str, tmp_path: Path) -> None:
    page = next(p for p in PAGES if any(b.directive == "run" for b in blocks(ROOT / p)))
    text = (ROOT / page).read_text()
    broken = tmp_path / Path(page).name
    # The first run block, made to fail as a renamed function would.
    marker = "<!-- run -->\n```"
    at = text.index(marker)
    end = text.index("\n", at + len(marker))
    lang = text[at + len(marker) : end].strip()
    line = 'raise SystemExit("broken")' if lang.startswith("py") else "exit 7"
    broken.write_text(text[: end + 1] + line + "\n" + text[end + 1 :])
    work = tmp_path / "work"
    work.mkdir()
    with pytest.raises(AssertionError, match=r"exited (1|7)"):
        run_page(broken, work, db_url)


@pytest.mark.parametrize(
    ("shown", "out", "same"),
    [
        ("a\nb\n", "a\nb\n", True),
        ("a\nb\n", "a\nc\n", False),
        ("a\n", "a\nb\n", False),
        ("…\nb\n", "x\ny\nb\n", True),
        ("…\nb\n", "b\n", True),
        ("a\n…\n", "a\n", True),
        ("…\nb\n", "x\nb\nc\n", False),
        ("a.b\n", "axb\n", False),
    ],
)
def test_output_is_compared_line_for_line_with_an_ellipsis_for_any_lines(
    shown: str, out: str, same: bool
) -> None:
    assert printed(shown, out) is same


def test_an_unmarked_example_fails(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text("# A page\n\n```python\nprint('hello')\n```\n\n```json\n{}\n```\n")
    assert unmarked(page) == [
        "page.md:4: a python block with no <!-- run -->, <!-- file: PATH --> or "
        "<!-- fragment --> before it"
    ]


@pytest.mark.parametrize(
    ("code", "problem"),
    [
        ("import outbox\noutbox.enqueu(s)\n", "`outbox.enqueu`: no such name"),
        ("from outbox import enqueu\n", "`from outbox import enqueu`: no such name"),
        ("import outbox.nothing\n", "`outbox.nothing` cannot be imported"),
        (
            "import outbox\nawait outbox.enqueue(s, destination='d', payload={}, keys='k')\n",
            "`outbox.enqueue(...)` takes no keyword `keys`",
        ),
        ("from outbox import Outbox\nOutbox(schema='x').enqueue\nOutbox.nope\n", "`Outbox.nope`"),
        ("def f(:\n", "not valid Python"),
    ],
)
def test_a_python_fragment_is_checked(code: str, problem: str) -> None:
    found = doc_checks.check_python(code, "page.md:1")
    assert len(found) == 1 and problem in found[0], found


def test_a_sound_python_fragment_passes() -> None:
    code = (
        "import outbox\nfrom outbox import Outbox\nfrom some_package_not_here import thing\n"
        "outbox = Outbox(schema='events')\noutbox.schema\n"
        "await Outbox().enqueue(s, destination='d', payload={})\n"
    )
    assert doc_checks.check_python(code, "p:1") == []


@pytest.mark.parametrize(
    ("code", "problem"),
    [
        (
            "outbox-relay migrate --databse-url x\n",
            "`outbox-relay migrate` has no option --databse-url",
        ),
        ("outbox-relay migrat\n", "`outbox-relay` has no command migrat"),
        ("FOO=1 outbox-relay endpoints ad x\n", "`outbox-relay endpoints` has no command ad"),
        ("./scripts/nothing-here --x\n", "`./scripts/nothing-here` is not a file"),
        (
            "outbox-relay run \\\n  --config relay.toml --nope\n",
            "`outbox-relay run` has no option --nope",
        ),
        ("echo hi && outbox-relay status --nope # a comment\n", "has no option --nope"),
    ],
)
def test_a_shell_fragment_is_checked(code: str, problem: str) -> None:
    found = doc_checks.check_shell(code, "page.md:1")
    assert len(found) == 1 and problem in found[0], found


def test_a_console_fragment_checks_its_commands_not_its_output() -> None:
    code = "$ outbox-relay status\noutbox-relay nonsense --that is output\n$ outbox-relay stat\n"
    assert doc_checks.check_shell(code, "p:1", console=True) == [
        "p:1: `outbox-relay` has no command stat"
    ]
    assert (
        doc_checks.check_shell("$ outbox-relay run --config relay.toml\n", "p:1", console=True)
        == []
    )


def test_a_toml_fragment_is_a_configuration_the_relay_accepts(tmp_path: Path) -> None:
    good = '[destinations.orders]\nkind = "kafka"\ntopic = "o"\n'
    assert doc_checks.check_toml(good, "p:1", tmp_path) == []
    (typo,) = doc_checks.check_toml(good + "max_atempts = 3\n", "p:1", tmp_path)
    assert "the relay refuses this configuration" in typo and "max_atempts" in typo
    (syntax,) = doc_checks.check_toml("[relay\n", "p:1", tmp_path)
    assert "not valid TOML" in syntax
    operators = '[ui]\nenabled = true\noperators = { alice = "a-token-of-alice-0123456789" }\n'
    assert doc_checks.check_toml(operators, "p:1", tmp_path) == []
    assert doc_checks.check_syntax("toml", "[relay\n", "p:1") != []
    assert doc_checks.check_syntax("toml", '[ui]\noperators_file = "/x"\n', "p:1") == []
