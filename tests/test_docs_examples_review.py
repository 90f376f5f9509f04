"""The docs' examples checker after a hostile review (issue #32), each with a test that failed
first: every way Markdown opens a code block is a block (indented in a list, `~~~`, four
backticks, `Python`, `shell-session`, unclosed), a directive that marks no block fails, a
command behind `sudo`, `env`, `do`, `$(...)` or `--` is checked, as are a missing option value
and an extra argument; a call of our instance's method, a positional argument too many, a name
shadowed only inside a function; the output comparison takes linear time; and neither the runs
nor the TOML check read the caller's OUTBOX_* variables."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from tests.support import doc_checks
from tests.support.doc_runner import printed, run_page, unmarked
from tests.support.markdown import blocks

# --- every block Markdown shows is one -----------------------------------------------------


PAGE = """\
# A page

1. A step:

   ```sh
   outbox-relay migrat
   ```

~~~python
print("tilde")
~~~

```Python
print("capital")
```

````python
print('''
```
''')
````

```shell-session
$ outbox-relay stat
```

```zsh
outbox-relay stat
```

```console title="x"
$ outbox-relay stat
```

```sh
never closed
"""


def test_every_fenced_block_markdown_shows_is_a_block(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text(PAGE)
    found = [(b.lang, b.line) for b in blocks(page)]
    assert found == [
        ("sh", 6),
        ("python", 10),
        ("python", 14),
        ("python", 18),
        ("shell-session", 24),
        ("zsh", 28),
        ("console", 32),
        ("sh", 36),
    ]
    # The indented block's code without its indentation; the four-backtick one whole.
    assert blocks(page)[0].code == "outbox-relay migrat\n"
    assert blocks(page)[3].code == "print('''\n```\n''')\n"
    assert len(unmarked(page)) == 8


def test_a_directive_indented_with_its_block_marks_it(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text("- step\n\n  <!-- fragment -->\n  ```sh\n  outbox-relay stat\n  ```\n")
    (b,) = blocks(page)
    assert (b.directive, b.code) == ("fragment", "outbox-relay stat\n")
    with pytest.raises(AssertionError, match=r"has no command stat"):
        run_page(page, tmp_path, "postgresql://docs@localhost/unused")


@pytest.mark.parametrize(
    "text",
    [
        # An output compared with nothing: a blank line parts it from its block.
        "<!-- run -->\n```sh\necho a\n```\n\n<!-- output -->\n\n```text\nb\n```\n",
        # A typo: the block is then a text block nobody checks.
        "<!-- run -->\n```sh\necho a\n```\n\n<!-- ouptut -->\n```text\nb\n```\n",
    ],
)
def test_a_directive_that_marks_no_block_fails(tmp_path: Path, text: str) -> None:
    page = tmp_path / "page.md"
    page.write_text(text)
    with pytest.raises(AssertionError, match=r"page\.md:6: .*marks no block"):
        run_page(page, tmp_path, "postgresql://docs@localhost/unused")


def test_a_pycon_block_is_checked_as_python(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text("<!-- fragment -->\n```pycon\n>>> import outbox\n>>> outbox.enqueu\n```\n")
    with pytest.raises(AssertionError, match=r"`outbox\.enqueu`: no such name"):
        run_page(page, tmp_path, "postgresql://docs@localhost/unused")


# --- shell ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "code",
    [
        "sudo outbox-relay migrat\n",
        "sudo -u relay -E outbox-relay migrat\n",
        "env OUTBOX_X=1 outbox-relay migrat\n",
        "env -i PATH=/bin outbox-relay migrat\n",
        "time outbox-relay migrat\n",
        "exec outbox-relay migrat\n",
        "nohup outbox-relay migrat &\n",
        "for i in 1 2; do outbox-relay migrat; done\n",
        "for i in 1 2; do\n  outbox-relay migrat\ndone\n",
        "if true; then outbox-relay migrat; fi\n",
        "! outbox-relay migrat\n",
        "{ outbox-relay migrat; }\n",
        'echo "$(outbox-relay migrat)"\n',
        "echo `outbox-relay migrat`\n",
        "kubectl exec deploy/orders -c relay -- outbox-relay migrat\n",
        "timeout 5 outbox-relay migrat\n",
    ],
)
def test_a_command_behind_a_prefix_is_checked(code: str) -> None:
    found = doc_checks.check_shell(code, "p:1")
    assert found == ["p:1: `outbox-relay` has no command migrat"], found


@pytest.mark.parametrize(
    ("code", "problem"),
    [
        ("outbox-relay run --config\n", "`outbox-relay run`: option --config needs a value"),
        ("outbox-relay pause orders billing\n", "`outbox-relay pause`: an extra argument billing"),
        ("outbox-relay migrate now\n", "`outbox-relay migrate`: an extra argument now"),
    ],
)
def test_a_missing_value_or_an_extra_argument_fails(code: str, problem: str) -> None:
    assert doc_checks.check_shell(code, "p:1") == [f"p:1: {problem}"]


@pytest.mark.parametrize(
    "code",
    [
        "outbox-relay catalog export -oevents.json --config relay.toml\n",
        "outbox-relay show 1 2 3\n",
        "outbox-relay endpoints add orders https://x.example/h --event-type a --event-type b\n",
        "pip install outbox-relay\n",
        "docker build -t outbox-relay .\n",
        "outbox-relay -h\n",
        "outbox-relay run --help\n",
    ],
)
def test_sound_commands_still_pass(code: str) -> None:
    assert doc_checks.check_shell(code, "p:1") == []


# --- Python --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("code", "problem"),
    [
        (
            "from outbox import Outbox\n"
            "await Outbox(schema='x').enqueue(s, destination='d', payload={}, keyy=1)\n",
            "takes no keyword `keyy`",
        ),
        (
            "from outbox import Outbox\nob = Outbox(schema='x')\n"
            "await ob.enqueue(s, destination='d', payload={}, keyy=1)\n",
            "`ob.enqueue(...)` takes no keyword `keyy`",
        ),
        (
            "from outbox import Outbox\nob = Outbox(schema='x')\nawait ob.enqueu(s)\n",
            "`ob.enqueu`: no such name",
        ),
        (
            "import outbox\nawait outbox.enqueue(s, 'orders', {'id': 1})\n",
            "`outbox.enqueue(...)` takes 1 positional argument, not 3",
        ),
        (
            "import outbox\n\n\ndef helper():\n    outbox = 1\n    return outbox\n\n\n"
            "await outbox.enqueue_one(s)\n",
            "`outbox.enqueue_one`: no such name",
        ),
    ],
)
def test_a_python_fragment_is_checked_through_instances_and_scopes(code: str, problem: str) -> None:
    found = doc_checks.check_python(code, "p:1")
    assert len(found) == 1 and problem in found[0], found


def test_what_an_instance_of_ours_holds_passes() -> None:
    code = (
        "from outbox import Outbox\nob = Outbox('events', max_payload_bytes=10)\n"
        "print(ob.schema, ob.max_payload_bytes)\n"
        "await ob.enqueue(s, destination='d', payload={}, key='k')\n"
        "ob.enqueue_sync(c, destination='d', payload={})\n"
        "def f(outbox):\n    return outbox.anything\n"
    )
    assert doc_checks.check_python(code, "p:1") == []


# --- output --------------------------------------------------------------------------------


def test_comparing_output_with_many_ellipses_takes_linear_time() -> None:
    shown = "…\nx\n" * 6 + "END\n"
    start = time.monotonic()
    assert not printed(shown, "x\n" * 400)
    assert printed(shown, "x\n" * 400 + "END\n")
    assert time.monotonic() - start < 1.0


# --- the caller's environment ----------------------------------------------------------------


def test_a_run_does_not_see_the_callers_outbox_variables(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("OUTBOX_RELAY_BATCH_SIZE", "7")
    monkeypatch.setenv("OUTBOX_SCHEMA", "someone_elses")
    page = tmp_path / "page.md"
    page.write_text(
        "<!-- run -->\n```sh\necho ${OUTBOX_RELAY_BATCH_SIZE-unset} ${OUTBOX_SCHEMA-unset}\n```\n"
        "<!-- output -->\n```text\nunset unset\n```\n"
    )
    work = tmp_path / "work"
    work.mkdir()
    run_page(page, work, "postgresql://docs@localhost/unused")


def test_a_toml_fragment_is_judged_without_the_callers_variables(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The environment wins over a file: a caller's valid value would hide the page's bad one.
    monkeypatch.setenv("OUTBOX_RELAY_BATCH_SIZE", "100")
    (bad,) = doc_checks.check_toml("[relay]\nbatch_size = 0\n", "p:1", tmp_path)
    assert "batch_size" in bad
    # And a caller's bad value does not fail the page's good one.
    monkeypatch.setenv("OUTBOX_LOG_LEVEL", "loud")
    assert doc_checks.check_toml("[relay]\nbatch_size = 10\n", "p:1", tmp_path) == []


def test_a_shell_block_written_to_a_file_or_shown_for_its_syntax_is_checked(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text("<!-- file: go.sh -->\n```sh\noutbox-relay migrat\n```\n")
    with pytest.raises(AssertionError, match=r"has no command migrat"):
        run_page(page, tmp_path, "postgresql://docs@localhost/unused")
    page.write_text("<!-- fragment: syntax -->\n```bash\nif then; fi\n```\n")
    with pytest.raises(AssertionError, match=r"page\.md:3: does not parse as sh"):
        run_page(page, tmp_path, "postgresql://docs@localhost/unused")
