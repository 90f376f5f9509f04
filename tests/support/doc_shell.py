"""What can be checked of a shell example the suite does not run: its `outbox-relay` commands,
their options and arguments exist (wherever the command stands: at the head of a line, after
`sudo`, `env`, `time`, `do`, in a `$(...)`, after the `--` of `kubectl exec`), as do the
repository's scripts and files it names. Each check returns the problems it found."""

from __future__ import annotations

import itertools
import re
import shlex
from collections.abc import Iterator
from pathlib import Path

import click

ROOT = Path(__file__).resolve().parent.parent.parent
# A file of the repository that a command names (./scripts/demo, -f deploy/compose.yaml).
_REPO_PATH = re.compile(r"^(?:\./)?(?:scripts|deploy|docs|migrations|tests|\.ci)/[\w./-]+$")
_ASSIGNMENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")
# Shell words after which a command starts (`for ...; do outbox-relay ...`).
_KEYWORDS = {"do", "then", "else", "elif", "if", "while", "until", "!", "{", "time"}
# Commands that run the command after them, and their options that take a value.
_WRAPPERS: dict[str, set[str]] = {
    "sudo": {"-u", "-g", "-C", "-D", "-h", "-p", "-r", "-t", "-U"},
    "doas": {"-u", "-C"},
    "env": {"-u", "-C", "-S"},
    "exec": {"-a"},
    "nohup": set(),
    "command": set(),
    "nice": {"-n"},
    "timeout": {"-s", "-k"},
    "watch": {"-n", "-d"},
    "xargs": {"-n", "-I", "-L", "-P", "-d", "-E", "-s", "-a"},
}
_SUBSTITUTION = re.compile(r"\$\(([^()]*)\)|`([^`]*)`")


def commands(code: str, console: bool) -> Iterator[list[str]]:
    """The simple commands of a shell block (a `console` block's are its `$ ` lines), as words,
    without the variables set before them; a command substituted inside one (`$(...)`, or
    backquotes) is one too."""
    lines: list[str] = []
    for raw in code.splitlines():
        if console and not lines and not raw.startswith("$ "):
            continue  # output
        line = raw[2:] if console and not lines else raw
        lines.append(line)
        if line.endswith("\\"):
            lines[-1] = line[:-1]
            continue
        yield from _simple(" ".join(lines))
        lines = []
    if lines:
        yield from _simple(" ".join(lines))


def _simple(line: str) -> Iterator[list[str]]:
    # Innermost substitutions first, each a command of its own and one word where it stood.
    while (m := _SUBSTITUTION.search(line)) is not None:
        yield from _simple(m[1] if m[1] is not None else m[2])
        line = line[: m.start()] + "SUBSTITUTED" + line[m.end() :]
    lexer = shlex.shlex(line, posix=True, punctuation_chars=";&|()<>")
    lexer.whitespace_split = True
    lexer.commenters = "#"
    try:
        tokens = list(lexer)
    except ValueError:  # an unbalanced quote: shown, not checked
        return
    words: list[str] = []
    for tok in [*tokens, ";"]:
        if tok and set(tok) <= set(";&|()<>"):
            while words and _ASSIGNMENT.match(words[0]):
                words.pop(0)
            if words:
                yield words
            words = []
        else:
            words.append(tok)


def _is_relay(word: str) -> bool:
    return word == "outbox-relay" or word.endswith("/outbox-relay")


def command(words: list[str]) -> list[str]:
    """The words of the command that ``words`` runs: past shell keywords, variables set for it
    and the commands that run another (`sudo -u relay`, `env -i X=1`, `timeout 5`), and past
    the `--` after which `kubectl exec` or `docker exec` name the command they run."""
    i = 0
    while i < len(words):
        word = words[i]
        if word in _KEYWORDS or _ASSIGNMENT.match(word):
            i += 1
        elif word in _WRAPPERS:
            i += 1
            while i < len(words) and (
                words[i].startswith("-") or (word == "env" and _ASSIGNMENT.match(words[i]))
            ):
                i += 2 if words[i] in _WRAPPERS[word] else 1
            if word == "timeout":
                i += 1  # its duration
        else:
            break
    rest = words[i:]
    if rest and not _is_relay(rest[0]) and "--" in rest:
        after = rest[rest.index("--") + 1 :]
        if after and _is_relay(after[0]):
            return after
    return rest


def check_shell(code: str, where: str, console: bool = False) -> list[str]:
    problems: list[str] = []
    for words in commands(code, console):
        run = command(words)
        if run and _is_relay(run[0]):
            problems += check_cli(run[1:], where)
        for word in _paths(run):
            if _REPO_PATH.match(word) and not (ROOT / word).exists():
                problems.append(f"{where}: `{word}` is not a file of the repository")
        if run[:2] == ["python", "manage.py"] and len(run) > 2:
            cmd = ROOT / "outbox" / "django" / "management" / "commands" / f"{run[2]}.py"
            if run[2].startswith("outbox") and not cmd.exists():
                problems.append(f"{where}: `manage.py {run[2]}`: no such command of ours")
    return problems


def _paths(words: list[str]) -> list[str]:
    """The words of a command that may name a file: for kubectl, only those of -f and -k
    (`deploy/orders` is a Deployment there)."""
    if words[:1] not in (["kubectl"], ["oc"]):
        return words
    files = ("-f", "-k", "--filename", "--kustomize")
    return [w for before, w in itertools.pairwise(words) if before in files]


def check_cli(args: list[str], where: str) -> list[str]:
    """``outbox-relay ARGS``: each subcommand exists, each option is one of its command's and
    has its value, and no argument is one more than the command takes."""
    from relay.cli import main

    cmd: click.Command = main
    path = "outbox-relay"
    # A synopsis's optional parts (`[--port 8089]`) are checked as the words they hold.
    args = [a.removeprefix("[").removesuffix("]") for a in args]
    positional: list[str] = []
    i = 0
    while i < len(args):
        arg = args[i]
        if arg == "--":
            break
        if arg.startswith("-") and arg != "-":
            step = _option_words(cmd, arg)
            if isinstance(step, str):
                return [f"{where}: `{path}`{step}"]
            if i + step > len(args):
                return [f"{where}: `{path}`: option {arg} needs a value"]
            i += step
            continue
        if isinstance(cmd, click.Group):
            sub = cmd.get_command(click.Context(cmd), arg)
            if sub is None:
                return [f"{where}: `{path}` has no command {arg}"]
            cmd, path = sub, f"{path} {arg}"
        else:
            positional.append(arg)
        i += 1
    takes = [p.nargs for p in cmd.params if isinstance(p, click.Argument)]
    if -1 not in takes and len(positional) > sum(takes):
        return [f"{where}: `{path}`: an extra argument {positional[sum(takes)]}"]
    return []


def _option_words(cmd: click.Command, arg: str) -> int | str:
    """How many words option ``arg`` takes with its value (`--x=1`, `-o1`: one), or what is
    wrong with it."""
    name, eq, _ = arg.partition("=")
    opt = _option(cmd, name)
    attached = False
    if opt is None and not arg.startswith("--") and len(arg) > 2:
        opt, attached = _option(cmd, arg[:2]), True  # -ofile
    if opt is None:
        return f" has no option {name}"
    if opt.is_flag or opt.count:
        return 1
    return 1 if eq or attached else 1 + opt.nargs


def _option(cmd: click.Command, name: str) -> click.Option | None:
    if name in ("--help", "-h"):
        return click.Option(["--help"], is_flag=True)
    for param in cmd.params:
        if isinstance(param, click.Option) and name in (*param.opts, *param.secondary_opts):
            return param
    return None


def check_syntax(code: str, where: str) -> list[str]:
    """A shell block that parses (`bash -n`), run by no one."""
    import subprocess

    res = subprocess.run(["bash", "-n", "-c", code], capture_output=True, text=True, timeout=30)
    return [] if res.returncode == 0 else [f"{where}: does not parse as sh: {res.stderr.strip()}"]
