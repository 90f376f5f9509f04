"""The command line for people: states in colour (never in JSON, never off a terminal, never
with NO_COLOR), progress of a purge and of a long retry on the terminal only, `status
--watch`, shell completion of the lazy command group, and a top-level help whose lines are
whole sentences. Some run the real command on a pseudo-terminal."""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click
import psycopg
import pytest
from click.testing import CliRunner, Result

from relay.cli import COMMANDS, main, render
from relay.cli import terminal as tty
from relay.cli.ops import status as status_cli
from tests.test_ops_cli import insert, sql, statuses

RED, GREEN, YELLOW = "\x1b[31m", "\x1b[32m", "\x1b[33m"
ESC = "\x1b["
LOCAL = "http://127.0.0.1:9/in"


def run(db_url: str | None, *args: str, color: bool = False, **env: str | None) -> Result:
    """``outbox-relay ARGS`` (the database URL from the environment), with NO_COLOR unset
    unless given: the test's own environment must not decide."""
    env = {"NO_COLOR": None, **env}
    if db_url is not None:
        env["OUTBOX_DATABASE_URL"] = db_url
    return CliRunner().invoke(main, list(args), env=env, color=color)


def ok(res: Result) -> Result:
    assert res.exit_code == 0, res.output
    return res


def child_env(db_url: str, **more: str) -> dict[str, str]:
    return {"PATH": "/usr/bin:/bin", "OUTBOX_DATABASE_URL": db_url, **more}


def spawn(
    args: list[str],
    env: dict[str, str],
    *,
    terminal: bool,
    interrupt_when: Callable[[str], bool] | None = None,
    timeout: float = 30,
) -> tuple[int, str]:
    """Run ``outbox-relay ARGS`` in a process of its own, its stdin, stdout and stderr on a
    pseudo-terminal (``terminal``) or a pipe; what it wrote, and its exit status. With
    ``interrupt_when``: Ctrl-C (SIGINT) once the output satisfies it."""
    if terminal:
        reader, writer = os.openpty()
        streams: dict[str, Any] = {"stdin": writer, "stdout": writer, "stderr": writer}
    else:
        reader, writer = os.pipe()
        streams = {"stdin": subprocess.DEVNULL, "stdout": writer, "stderr": writer}
    # With Ctrl-C's default action, as a command typed at a terminal has: a suite started in
    # the background (`./scripts/test &`) runs with SIGINT ignored, which a child inherits,
    # and Python then installs no handler for it.
    proc = subprocess.Popen(
        [sys.executable, "-m", "relay.cli", *args],
        env=env,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
        **streams,
    )
    os.close(writer)
    out = b""
    interrupted = False
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            if not select.select([reader], [], [], 0.1)[0]:
                continue
            try:
                chunk = os.read(reader, 65536)
            except OSError:  # EIO: the terminal's last writer is gone
                break
            if not chunk:
                break
            out += chunk
            if interrupt_when and not interrupted and interrupt_when(out.decode(errors="replace")):
                proc.send_signal(signal.SIGINT)
                interrupted = True
        else:
            proc.kill()
            proc.wait(timeout=10)  # not left to be reported by a later test
            pytest.fail(f"outbox-relay {' '.join(args)} still running: {out.decode()[-2000:]}")
    finally:
        os.close(reader)
    return proc.wait(timeout=10), out.decode(errors="replace")


def a_busy_outbox(db_url: str) -> None:
    """Failed, delivered and pending rows; emails paused."""
    insert(db_url, "orders", "failed", n=2, error="boom", attempts=25)
    insert(db_url, "orders", "delivered", n=3)
    insert(db_url, "orders", n=1, age="10 min")  # OLDEST 10m, however long the test takes
    insert(db_url, "emails", "delivered", n=1)
    ok(run(db_url, "pause", "emails", "--reason", "vendor outage"))


# --- colour -----------------------------------------------------------------------------------


def test_states_are_coloured_and_the_columns_stay_aligned(db_url: str) -> None:
    a_busy_outbox(db_url)
    coloured = ok(run(db_url, "status", color=True)).output
    plain = ok(run(db_url, "status")).output
    assert ESC not in plain  # off a terminal click.echo takes the colour out
    assert click.unstyle(coloured) == plain  # colour adds nothing but colour
    emails, orders = (
        line for line in coloured.splitlines() if line.startswith(("emails", "orders"))
    )
    assert f"{YELLOW}PAUSED since" in emails and f"{GREEN}active" in orders
    assert f"{RED}2\x1b[0m  " in orders  # the failed count; none failed in emails, no red
    assert RED not in emails

    listed = ok(run(db_url, "list", color=True)).output
    assert f"{RED}failed" in listed and f"{GREEN}delivered" in listed
    assert click.unstyle(listed) == ok(run(db_url, "list")).output
    failed_id = min(i for i, (s, _) in statuses(db_url).items() if s == "failed")
    shown = ok(run(db_url, "show", str(failed_id), color=True)).output
    assert [line.split()[1] for line in shown.splitlines() if line.startswith("status:")] == [
        f"{RED}failed\x1b[0m"
    ]


def test_endpoint_states_and_open_circuits_are_coloured(db_url: str) -> None:
    for _ in range(2):
        ok(run(db_url, "endpoints", "add", "orders", LOCAL, "--allow-private-networks"))
    [(first,), (second,)] = sql(db_url, "SELECT id FROM outbox_endpoints ORDER BY id")
    ok(run(db_url, "endpoints", "disable", str(second), "--reason", "moved"))
    sql(
        db_url,
        "UPDATE outbox_endpoints SET circuit_open_until = now() + interval '1 min' WHERE id = %s",
        first,
    )
    listed = ok(run(db_url, "endpoints", "list", color=True)).output
    assert f"{GREEN}enabled" in listed and f"{RED}disabled: moved" in listed
    shown = ok(run(db_url, "endpoints", "show", str(second), color=True)).output
    assert f"{RED}disabled: moved" in shown
    status = ok(run(db_url, "status", color=True)).output
    assert f"{RED}open until" in status and f"{RED}DISABLED: moved" in status
    assert click.unstyle(status) == ok(run(db_url, "status")).output


def test_no_color_and_the_color_options(db_url: str) -> None:
    a_busy_outbox(db_url)
    # NO_COLOR set to anything but "" takes the colour away, even where it would be shown.
    assert ESC not in ok(run(db_url, "status", color=True, NO_COLOR="1")).output
    assert ESC in ok(run(db_url, "status", color=True, NO_COLOR="")).output
    assert ESC not in ok(run(db_url, "--no-color", "status", color=True)).output
    # --color colours off a terminal too (for `less -R`), and beats NO_COLOR.
    assert f"{RED}2" in ok(run(db_url, "--color", "status")).output
    assert ESC in ok(run(db_url, "--color", "status", NO_COLOR="1")).output
    # JSON is never coloured, whatever is asked.
    for args in (["status", "--json"], ["list", "--json"]):
        out = ok(run(db_url, "--color", *args, color=True)).output
        assert ESC not in out
        json.loads(out)


def test_colour_on_a_terminal_only(db_url: str) -> None:
    """The real command: coloured on a pseudo-terminal, plain through a pipe or with
    NO_COLOR."""
    a_busy_outbox(db_url)
    status, out = spawn(["status"], child_env(db_url), terminal=True)
    assert status == 0, out
    assert f"{RED}2" in out and f"{YELLOW}PAUSED" in out
    status, out = spawn(["status"], child_env(db_url, NO_COLOR="1"), terminal=True)
    assert status == 0 and "PAUSED" in out and ESC not in out, out
    status, out = spawn(["status"], child_env(db_url), terminal=False)
    assert status == 0 and "PAUSED" in out and ESC not in out, out


# --- progress ---------------------------------------------------------------------------------


@pytest.fixture
def terminal_stderr(monkeypatch: pytest.MonkeyPatch) -> None:
    """stderr is a terminal, and every progress line is drawn."""
    monkeypatch.setattr(tty, "stderr", lambda: True)
    monkeypatch.setattr(render, "REDRAW", 0.0)


def test_purge_shows_its_progress_on_a_terminal(db_url: str, terminal_stderr: None) -> None:
    insert(db_url, "orders", "delivered", n=25, delivered_ago="8 days")
    purge = ("purge", "--older-than", "7d", "--batch-size", "10", "--yes")
    res = ok(run(db_url, *purge))
    drawn = [part.strip() for part in res.stderr.split("\r") if part.strip()]
    assert drawn == [  # each batch (the last, of skipped rows, deletes none)
        "purging: 0 of 25 row(s) deleted (0%)",
        "purging: 10 of 25 row(s) deleted (40%)",
        "purging: 20 of 25 row(s) deleted (80%)",
        "purging: 25 of 25 row(s) deleted (100%)",
    ]
    assert res.stderr.endswith("\r")  # wiped: the summary stands alone
    assert res.stdout == "deleted 25 delivered, 0 skipped row(s) older than 7d in 4 batch(es)\n"

    insert(db_url, "orders", "delivered", n=5, delivered_ago="8 days")
    res = ok(run(db_url, *purge, "--dry-run"))
    assert res.stderr == "" and len(statuses(db_url)) == 5
    res = ok(run(db_url, *purge, "--json"))
    assert res.stderr == "" and json.loads(res.stdout)["rows"] == 5


def test_purge_shows_no_progress_off_a_terminal(db_url: str) -> None:
    insert(db_url, "orders", "delivered", n=25, delivered_ago="8 days")
    res = ok(run(db_url, "purge", "--older-than", "7d", "--batch-size", "10", "--yes"))
    assert res.stderr == "" and "deleted 25 delivered" in res.stdout


def test_purge_progress_on_a_real_terminal(db_url: str) -> None:
    args = ["purge", "--older-than", "7d", "--batch-size", "10", "--yes"]
    for terminal in (True, False):
        insert(db_url, "orders", "delivered", n=25, delivered_ago="8 days")
        status, out = spawn(args, child_env(db_url), terminal=terminal)
        assert status == 0 and "deleted 25 delivered" in out, out
        assert ("purging: 0 of 25 row(s) deleted (0%)" in out) is terminal, out


def locked_for(db_url: str, seconds: float) -> threading.Thread:
    """The outbox locked against updates, released after ``seconds``."""
    locked = threading.Event()

    def hold() -> None:
        with psycopg.connect(db_url) as c:
            c.execute("LOCK TABLE outbox IN SHARE MODE")
            locked.set()
            time.sleep(seconds)

    holder = threading.Thread(target=hold)
    holder.start()
    assert locked.wait(10)
    return holder


def test_a_long_retry_says_how_long_it_has_run(
    db_url: str, terminal_stderr: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(render, "ELAPSED_AFTER", 0.2)
    ids = insert(db_url, "orders", "failed", n=3, error="boom")
    holder = locked_for(db_url, 2.0)
    res = ok(run(db_url, "retry", "--all", "--yes"))
    holder.join()
    assert "retrying… 0s" in res.stderr and "retrying… 1s" in res.stderr, res.stderr
    assert res.stderr.endswith("\r") and res.stdout.startswith("retried 3 failed row(s)")
    assert {s for i, (s, _) in statuses(db_url).items() if i in ids} == {"pending"}

    # A quick one says nothing, nor one with --json, nor one off a terminal.
    insert(db_url, "orders", "failed", error="boom")
    monkeypatch.setattr(render, "ELAPSED_AFTER", 1.0)
    assert ok(run(db_url, "retry", "--all", "--yes")).stderr == ""
    monkeypatch.setattr(render, "ELAPSED_AFTER", 0.0)
    insert(db_url, "orders", "failed", error="boom")
    holder = locked_for(db_url, 0.5)
    res = ok(run(db_url, "retry", "--all", "--yes", "--json"))
    holder.join()
    assert res.stderr == "" and json.loads(res.stdout)["rows"] == 1


# --- status --watch ---------------------------------------------------------------------------


def interrupted_after(
    snapshots: int, monkeypatch: pytest.MonkeyPatch, between: Callable[[], None]
) -> list[float]:
    """--watch's pause: ``between`` after the first snapshot, Ctrl-C after the last."""
    pauses: list[float] = []

    def sleep(seconds: float) -> None:
        pauses.append(seconds)
        if len(pauses) == 1:
            between()
        if len(pauses) == snapshots:
            raise KeyboardInterrupt

    monkeypatch.setattr(status_cli, "_sleep", sleep)
    return pauses


def test_watch_prints_snapshots_until_interrupted(
    db_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    insert(db_url, "orders", n=2)
    pauses = interrupted_after(2, monkeypatch, lambda: insert(db_url, "orders", "failed"))
    res = ok(run(db_url, "status", "--watch"))
    assert pauses == [2.0, 2.0]
    first, second = res.stdout.split("\n\n--- ")
    assert first.startswith("--- ") and first.count("--- ") == 1
    failed = [  # the FAILED column of orders in each snapshot
        line.split()[-3]
        for snapshot in (first, second)
        for line in snapshot.splitlines()
        if line.startswith("orders")
    ]
    assert failed == ["0", "1"]  # a row failed between the two

    pauses = interrupted_after(3, monkeypatch, lambda: None)
    res = ok(run(db_url, "status", "--watch", "0.5", "--json"))
    docs = [json.loads(line) for line in res.stdout.splitlines()]
    assert pauses == [0.5] * 3 and len(docs) == 3
    assert docs[0]["totals"]["failed"] == 1 and docs[0]["problems"] == []


def test_watch_redraws_a_terminal(db_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tty, "stdout", lambda: True)
    interrupted_after(2, monkeypatch, lambda: None)
    out = ok(run(db_url, "status", "--watch", "1.5")).stdout
    assert out.count(status_cli.CLEAR_SCREEN) == 2 and out.count("every 1.5s, ") == 2
    assert out.endswith("\n\n")  # after ^C the prompt starts a line


def test_watch_usage(db_url: str) -> None:
    res = run(db_url, "status", "--watch", "0.1")
    assert res.exit_code == 2 and "0.5<=x<=3600" in res.output
    res = run(db_url, "status", "--watch", "--fail-if-failed")
    assert res.exit_code == 2 and "not with --watch" in res.output
    assert "--watch [SECONDS]" in ok(run(None, "status", "--help")).output


@pytest.mark.parametrize("terminal", [False, True])
def test_watch_until_ctrl_c_in_a_real_process(db_url: str, terminal: bool) -> None:
    insert(db_url, "orders", n=1)
    header = "Ctrl-C to stop" if terminal else "--- "
    status, out = spawn(
        ["status", "--watch", "0.5"],
        child_env(db_url),
        terminal=terminal,
        interrupt_when=lambda text: text.count("orders") >= 2,  # two whole snapshots
    )
    assert status == 0, out  # Ctrl-C ends a watch: no error, no traceback
    assert out.count(header) >= 2 and "Traceback" not in out and "Aborted" not in out
    assert (status_cli.CLEAR_SCREEN in out) is terminal


# --- shell completion ---------------------------------------------------------------------------


def complete(shell: str, words: str, cword: int | str) -> str:
    env = {
        "_OUTBOX_RELAY_COMPLETE": f"{shell}_complete",
        "COMP_WORDS": words,
        "COMP_CWORD": str(cword),
    }
    res = CliRunner().invoke(main, [], env=env, prog_name="outbox-relay")
    assert res.exit_code == 0, res.output
    return res.output


def test_completion_of_command_names_and_options() -> None:
    names = [line.split(",", 1)[1] for line in complete("bash", "outbox-relay ", 1).splitlines()]
    assert names == sorted(COMMANDS)
    assert complete("bash", "outbox-relay st", 1).splitlines() == ["plain,status"]
    options = complete("bash", "outbox-relay status --", 2).splitlines()
    assert {"plain,--watch", "plain,--json", "plain,--database-url"} <= set(options)
    assert "plain,--no-color" in complete("bash", "outbox-relay --", 1).splitlines()
    nested = complete("bash", "outbox-relay endpoints d", 2).splitlines()
    assert nested == ["plain,delete", "plain,disable"]
    # zsh and fish show each command's short help: whole, never cut with "...".
    zsh = complete("zsh", "outbox-relay ", 1).splitlines()
    described = dict(zip(zsh[1::3], zsh[2::3], strict=True))
    assert described["status"] == status_cli.status.short_help
    assert not [d for d in described.values() if d.endswith("...")]
    fish = complete("fish", "outbox-relay pu", "pu")
    assert fish.startswith("plain,purge\tDelete old delivered") and "..." not in fish


def test_completion_scripts_of_the_installed_command() -> None:
    command = Path(sys.executable).with_name("outbox-relay")
    for shell, marker in [
        ("bash", "complete -o nosort -F _outbox_relay_completion outbox-relay"),
        ("zsh", "#compdef outbox-relay"),
        ("fish", "complete --no-files --command outbox-relay"),
    ]:
        script = subprocess.run(
            [command],
            env={"PATH": "/usr/bin:/bin", "_OUTBOX_RELAY_COMPLETE": f"{shell}_source"},
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert script.returncode == 0 and marker in script.stdout, script.stdout + script.stderr
    done = subprocess.run(
        [command],
        env={
            "PATH": "/usr/bin:/bin",
            "_OUTBOX_RELAY_COMPLETE": "bash_complete",
            "COMP_WORDS": "outbox-relay re",
            "COMP_CWORD": "1",
        },
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.stdout.splitlines() == ["plain,replay", "plain,resume", "plain,retry"]


# --- help ---------------------------------------------------------------------------------------


def listed_commands(help_text: str) -> dict[str, list[str]]:
    """The Commands section of a help: each name and the lines of its description."""
    section = help_text.split("\nCommands:\n", 1)[1]
    listed: dict[str, list[str]] = {}
    name = ""
    for line in section.splitlines():
        if not line.strip():
            break
        if line.startswith("  ") and not line.startswith("   "):
            name, _, text = line.strip().partition(" ")
            listed[name] = [text.strip()]
        else:
            listed[name].append(line.strip())
    return listed


@pytest.mark.parametrize("group", [[], ["endpoints"], ["bench"]])
@pytest.mark.parametrize("width", [80, 50])
def test_the_help_lists_every_command_in_whole_sentences(group: list[str], width: int) -> None:
    res = CliRunner().invoke(main, [*group, "--help"], terminal_width=width)
    assert res.exit_code == 0, res.output
    listed = listed_commands(res.output)
    command: click.Group = main
    for name in group:
        found = command.get_command(click.Context(command), name)
        assert isinstance(found, click.Group)
        command = found
    ctx = click.Context(command)
    assert list(listed) == command.list_commands(ctx)
    for name, lines in listed.items():
        sub = command.get_command(ctx, name)
        assert sub is not None
        text = " ".join(lines)
        assert text.endswith(".") and not text.endswith("..."), (name, text)
        # Its own short help, whole; what completion shows (up to 45 characters) too.
        assert text == sub.short_help == sub.get_short_help_str(), name
        if width == 80:
            assert len(lines) == 1, (name, lines)  # on one line
