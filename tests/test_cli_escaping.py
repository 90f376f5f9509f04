"""Text from receivers and from the database never reaches a terminal raw.

A receiver's answer ends up in ``last_error`` and in the message log; keys, tenants,
descriptions and destination names come from applications. The commands print them escaped
(``\\x1b``, ``\\n``, ``\\u202e``), so that none can retitle the terminal, clear it, forge a line or
reorder what follows; JSON keeps the text exactly as stored."""

from __future__ import annotations

import ast
import json
import re
import unicodedata
from pathlib import Path
from typing import Any

from click.testing import CliRunner, Result
from hypothesis import given
from hypothesis import strategies as st

from relay.cli import main
from tests.test_cli_polish import child_env, spawn
from tests.test_endpoint_ops import attempt, delivery, endpoint, event
from tests.test_ops_cli import insert, sql

# Everything a terminal acts on rather than shows: an OSC title, a CSI clear screen, SGR
# conceal, a newline that forges a line, a carriage return that overwrites one, the C1 forms of
# CSI and of a new line, bidi overrides and isolates, a line separator.
HOSTILE = (
    "boom\x1b]0;pwned\x07\x1b[2J\x1b[8m\nFORGED all delivered\rOVERWRITTEN"
    "\x9b2J\x85NEL\u202edesrever\u2066iso\u2069\u2028end"
)
# How the start of it reads on the screen.
SHOWN = r"boom\x1b]0;pwned\x07\x1b[2J\x1b[8m\nFORGED"

# The colours the commands themselves write (click.style: red, green, yellow; reset).
OUR_COLOURS = re.compile(r"\x1b\[(?:3[123]|0)m")

ROOT = Path(__file__).resolve().parents[1]


def run(db_url: str, *args: str, color: bool = True) -> Result:
    """``outbox-relay ARGS`` as on a terminal (colour kept: click would strip some escape
    sequences from a pipe, which no terminal does)."""
    env = {"NO_COLOR": None, "OUTBOX_DATABASE_URL": db_url}
    return CliRunner().invoke(main, list(args), env=env, color=color)


def hidden(text: str) -> list[str]:
    """The characters of ``text`` a terminal would act on or not show, besides the line
    breaks between lines and the commands' own colours."""
    plain = OUR_COLOURS.sub("", text)
    return sorted(
        {c for c in plain if c != "\n" and not c.isprintable() and unicodedata.category(c) != "Zs"}
    )


def assert_safe(res: Result, *, shown: str = SHOWN) -> None:
    for name, text in (("stdout", res.stdout), ("stderr", res.stderr)):
        assert not hidden(text), f"raw {hidden(text)} on {name}:\n{text!r}"
        assert "\nFORGED" not in text, f"a forged line on {name}:\n{text}"
    assert shown in res.output, res.output


def hostile_outbox(db_url: str) -> dict[str, int]:
    """An event of an `endpoints` destination that failed with HOSTILE everywhere a receiver
    or an application can put text: its key, last error, headers and payload; its delivery's
    last error; the message log's error and response; the endpoint's tenant, event types,
    description and disabled reason."""
    e = event(db_url, status="failed")
    sql(
        db_url,
        "UPDATE outbox SET key = %s, last_error = %s, headers = %s::jsonb, payload = %s, "
        "content_type = 'text/plain', tenant = %s, event_type = %s WHERE id = %s",
        HOSTILE,
        HOSTILE,
        json.dumps({"x-note": HOSTILE}),
        HOSTILE.encode(),
        HOSTILE,
        HOSTILE,
        e,
    )
    ep = endpoint(db_url, enabled=False, reason=HOSTILE, failing_ago="1 hour")
    sql(
        db_url,
        "UPDATE outbox_endpoints SET tenant = %s, event_types = %s, description = %s WHERE id = %s",
        HOSTILE,
        [HOSTILE],
        HOSTILE,
        ep,
    )
    d = delivery(db_url, e, ep, "failed", attempts=2, last_status=500, error=HOSTILE)
    attempt(db_url, d, http_status=500, response=HOSTILE, ago="1 min")
    attempt(db_url, d, http_status=None, error=HOSTILE)
    return {"event": e, "endpoint": ep, "delivery": d}


def test_show_escapes_what_receivers_and_applications_wrote(db_url: str) -> None:
    ids = hostile_outbox(db_url)
    res = run(db_url, "show", str(ids["event"]))
    assert res.exit_code == 0, res.output
    assert_safe(res)
    lines = res.stdout.splitlines()
    # Every field on its own line, whatever its text holds.
    for field in ("key:", "last_error:", "headers:", "payload_preview:"):
        assert sum(line.startswith(field) for line in lines) == 1, (field, lines)
    assert "response: " + SHOWN[:60] in res.stdout  # the receiver's answer, escaped
    # Plain text through a pipe (no colour) is escaped all the same.
    assert_safe(run(db_url, "show", str(ids["event"]), color=False))

    data = json.loads(run(db_url, "show", str(ids["event"]), "--json", color=False).stdout)
    [row] = data["rows"]
    assert (row["key"], row["last_error"], row["payload_preview"]) == (HOSTILE,) * 3
    assert row["headers"] == {"x-note": HOSTILE}
    assert data["deliveries"][0]["last_error"] == HOSTILE
    assert {a["response"] or a["error"] for a in data["attempts"]} == {HOSTILE}


def test_endpoints_show_and_list_escape_what_they_print(db_url: str) -> None:
    ids = hostile_outbox(db_url)
    shown = run(db_url, "endpoints", "show", str(ids["endpoint"]))
    assert shown.exit_code == 0, shown.output
    assert_safe(shown)
    for field in ("tenant:", "event_types:", "description:", "state:", "last_error:"):
        assert sum(line.startswith(field) for line in shown.stdout.splitlines()) == 1, field
    listed = run(db_url, "endpoints", "list")
    assert listed.exit_code == 0, listed.output
    assert_safe(listed)
    assert len(listed.stdout.splitlines()) == 2  # the header and the one endpoint

    data = json.loads(run(db_url, "endpoints", "show", str(ids["endpoint"]), "--json").stdout)
    assert (data["tenant"], data["event_types"], data["description"]) == (
        HOSTILE,
        [HOSTILE],
        HOSTILE,
    )
    assert data["disabled_reason"] == HOSTILE and data["deliveries"]["last_error"] == HOSTILE
    assert data["recent_attempts"][0]["error"] == HOSTILE
    [ep] = json.loads(run(db_url, "endpoints", "list", "--json").stdout)["endpoints"]
    assert ep["tenant"] == HOSTILE


def test_list_escapes_keys_errors_and_destinations(db_url: str) -> None:
    [row] = insert(db_url, HOSTILE, "failed", error=HOSTILE, attempts=3)
    sql(db_url, "UPDATE outbox SET key = %s WHERE id = %s", HOSTILE, row)
    res = run(db_url, "list")
    assert res.exit_code == 0, res.output
    assert_safe(res)
    assert len(res.stdout.splitlines()) == 2  # the header and the one row

    [listed] = json.loads(run(db_url, "list", "--json").stdout)["rows"]
    assert (listed["destination"], listed["key"], listed["last_error"]) == (HOSTILE,) * 3


def test_status_escapes_destinations_errors_pauses_relays_and_endpoints(db_url: str) -> None:
    insert(db_url, HOSTILE, "failed", error=HOSTILE, attempts=3)
    insert(db_url, HOSTILE, age="1 hour")
    insert(db_url, HOSTILE, "running", locked_by=HOSTILE)
    paused = run(db_url, "pause", HOSTILE, "--reason", HOSTILE, "--by", HOSTILE)
    assert paused.exit_code == 0, paused.output
    sql(
        db_url,
        "INSERT INTO outbox_relays (relay_id, host, pid, version, destinations, seen_at) "
        "VALUES (%s, %s, 1, '1.0', %s, now())",
        HOSTILE,
        HOSTILE,
        [HOSTILE],
    )
    endpoint(db_url, enabled=False, reason=HOSTILE)

    res = run(db_url, "status")
    assert res.exit_code == 0, res.output
    assert_safe(res)
    for block in ("relays:", "in flight:", "failed (retry with", "endpoints (1 registered"):
        assert block in res.stdout, block
    data = json.loads(run(db_url, "status", "--json").stdout)
    [dest] = data["destinations"]
    assert dest["destination"] == HOSTILE and data["relays"][0]["relay_id"] == HOSTILE
    assert dest["paused"]["reason"] == HOSTILE and dest["paused"]["by"] == HOSTILE
    assert dest["failed_errors"][0]["error"] == HOSTILE
    assert dest["in_flight"][0]["relay"] == HOSTILE

    # The problem line on stderr names the destinations.
    late = run(db_url, "status", "--fail-if-pending-older-than", "1m")
    assert late.exit_code == 3 and "problem:" in late.stderr
    assert_safe(late)
    assert_safe(paused)  # `pause` repeats the name it was given


def test_blocked_keys_in_status_are_escaped(db_url: str) -> None:
    [blocking] = insert(db_url, "orders", "failed", error=HOSTILE, attempts=3)
    [waiting] = insert(db_url, "orders")
    sql(db_url, "UPDATE outbox SET key = %s WHERE id IN (%s, %s)", HOSTILE, blocking, waiting)
    res = run(db_url, "status")
    assert res.exit_code == 0, res.output
    assert_safe(res)
    assert "keys with a failed row ahead of pending rows" in res.stdout
    blocked = json.loads(run(db_url, "status", "--json").stdout)["destinations"][0]
    assert blocked["blocked_keys"][0]["key"] == HOSTILE


def test_error_messages_escape_what_they_quote(db_url: str) -> None:
    insert(db_url, HOSTILE, "failed", error="x", attempts=3)
    # Off a terminal a retry by filter refuses, naming the destinations it would touch.
    refused = run(db_url, "retry", "--all")
    assert refused.exit_code == 2, refused.output
    assert_safe(refused, shown=r"boom\x1b]0;pwned")
    assert "pass --yes" in refused.stderr
    # A value quoted back from the command line (click quotes it itself, as repr does).
    bad = run(db_url, "list", "--status", HOSTILE)
    assert bad.exit_code == 2
    assert_safe(bad, shown="boom")
    resumed = run(db_url, "resume", HOSTILE)
    assert resumed.exit_code == 0
    assert_safe(resumed)


def test_configuration_errors_escape_the_names_they_quote(tmp_path: Path, db_url: str) -> None:
    # A destination's name is a TOML key: any text at all, quoted back by the error.
    escaped = json.dumps(HOSTILE)  # a TOML basic string takes JSON's escapes
    config = tmp_path / "relay.toml"
    config.write_text(f'database_url = "{db_url}"\n[destinations.{escaped}]\nkind = "nope"\n')
    for args in (["run", "--check"], ["status"]):
        res = CliRunner().invoke(main, [*args, "--config", str(config)], color=True)
        assert res.exit_code == 2, res.output
        assert_safe(res)
        # Its problems each on a line of their own, as written.
        lines = res.stderr.splitlines()
        assert lines[0].startswith("outbox-relay: invalid configuration in ")
        assert lines[1].startswith(f"  destinations.'{SHOWN}") and len(lines) == 2, lines


def test_on_a_real_terminal_nothing_raw_arrives(db_url: str) -> None:
    ids = hostile_outbox(db_url)
    for args in (["show", str(ids["event"])], ["endpoints", "show", str(ids["endpoint"])]):
        status, out = spawn(args, child_env(db_url), terminal=True)
        assert status == 0, out
        screen = out.replace("\r\n", "\n")  # the terminal's own line ends
        assert not hidden(screen), (args, hidden(screen), screen)
        assert "\nFORGED" not in screen and SHOWN in screen
        assert OUR_COLOURS.search(screen)  # a terminal: the states are coloured


# --- printable ------------------------------------------------------------------------------


def test_printable_escapes_what_a_terminal_acts_on_and_keeps_the_rest() -> None:
    from relay.cli.render import printable

    assert printable(HOSTILE) == (
        r"boom\x1b]0;pwned\x07\x1b[2J\x1b[8m\nFORGED all delivered\rOVERWRITTEN"
        r"\x9b2J\x85NEL\u202edesrever\u2066iso\u2069\u2028end"
    )
    assert printable("\t\x00\x7f\u200b\ufeff\U000e0041") == r"\t\x00\x7f\u200b\ufeff\U000e0041"
    assert printable("\ud800") == r"\ud800"  # a lone surrogate, as a bad command line has
    readable = "Grüße aus 東京: ok 👍 — naïve, 1\u00a0000\u3000€ (C:\\temp)"
    assert printable(readable) == readable


@given(st.text())
def test_printable_leaves_nothing_hidden_and_escapes_once(text: str) -> None:
    from relay.cli.render import printable

    shown = printable(text)
    assert not hidden(shown) and "\n" not in shown
    assert printable(shown) == shown  # escaping escaped text changes nothing


def test_every_command_writes_text_through_the_escaping() -> None:
    """click.echo, print and click's prompts are called in relay/cli/render.py only, where
    echo() and confirm() escape what they write."""
    writers = {"echo", "secho", "confirm", "prompt", "print"}
    found = []
    for path in sorted((ROOT / "relay" / "cli").rglob("*.py")):
        if path.name == "render.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Call):
                continue
            f: Any = node.func
            direct = isinstance(f, ast.Name) and f.id == "print"
            via_click = (
                isinstance(f, ast.Attribute)
                and f.attr in writers
                and isinstance(f.value, ast.Name)
                and f.value.id in {"click", "sys"}
            )
            if direct or via_click:
                found.append(f"{path.name}:{node.lineno}")
    assert not found, found
