"""What can be checked of an example the suite does not run (a `<!-- fragment -->` of a page):
its Python compiles, what it imports exists, the names it takes from our packages and the
keywords it passes them exist; its `outbox-relay` commands and their options exist, as do the
repository's scripts and files it names; its TOML is a relay configuration the relay accepts.
A fragment that names a function we renamed fails as a run example would.

Each check returns the problems it found, as lines that name the block's place."""

from __future__ import annotations

import ast
import contextlib
import importlib
import inspect
import os
import re
import shlex
import tomllib
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import click

ROOT = Path(__file__).resolve().parent.parent.parent
# Our packages: what a page imports of them must exist. Another package need not be installed
# here (a page may show the CloudEvents SDK), but when it is, what the page takes of it must
# exist too.
OURS = ("outbox", "relay")
# A file of the repository that a command names (./scripts/demo, -f deploy/compose.yaml).
_REPO_PATH = re.compile(r"^(?:\./)?(?:scripts|deploy|docs|migrations|tests|\.ci)/[\w./-]+$")
_MISSING = object()


# --- Python ------------------------------------------------------------------------------------


def check_python(code: str, where: str) -> list[str]:
    try:
        tree = compile(code, where, "exec", ast.PyCF_ONLY_AST | ast.PyCF_ALLOW_TOP_LEVEL_AWAIT)
    except SyntaxError as exc:
        return [f"{where}: not valid Python: {exc.msg} (line {exc.lineno})"]
    assert isinstance(tree, ast.Module)
    problems: list[str] = []
    bound: dict[str, object] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                mod = _module(alias.name, where, problems)
                if mod is not None:
                    if alias.asname:
                        bound[alias.asname] = mod
                    else:
                        top = alias.name.partition(".")[0]
                        bound[top] = importlib.import_module(top)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            mod = _module(node.module, where, problems)
            for alias in node.names if mod is not None else ():
                if alias.name == "*":
                    continue
                value = _attribute(mod, alias.name, node.module)
                if value is _MISSING:
                    problems.append(
                        f"{where}: `from {node.module} import {alias.name}`: no such name"
                    )
                else:
                    bound[alias.asname or alias.name] = value
    # A name the example assigns is no longer the import's.
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            bound.pop(node.id, None)
    problems += _uses(tree, bound, where)
    return problems


def _module(name: str, where: str, problems: list[str]) -> types.ModuleType | None:
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as exc:
        if name.partition(".")[0] in OURS:
            problems.append(f"{where}: `{name}` cannot be imported: {exc}")
        return None
    except ImportError as exc:  # a module that needs what this process lacks (Django settings)
        if name.partition(".")[0] in OURS:
            problems.append(f"{where}: `{name}` cannot be imported: {exc}")
        return None


def _attribute(owner: object, name: str, owner_name: str) -> object:
    value = getattr(owner, name, _MISSING)
    if value is _MISSING and isinstance(owner, types.ModuleType):
        with contextlib.suppress(ImportError):
            return importlib.import_module(f"{owner_name}.{name}")
    return value


def _chain(node: ast.expr) -> list[str] | None:
    """``a.b.c`` as ["a", "b", "c"]; None for anything else."""
    parts: list[str] = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    return [node.id, *reversed(parts)]


def _resolve(parts: list[str], bound: dict[str, object], where: str) -> tuple[object, str | None]:
    """What ``parts`` names, and a problem if a name along it is missing. Followed through
    modules and classes only: an instance's attributes are not known before it runs."""
    value = bound[parts[0]]
    path = parts[0]
    for attr in parts[1:]:
        # type(): a lazy object (Django's settings) would set itself up for isinstance().
        if not issubclass(type(value), (types.ModuleType, type)):
            return _MISSING, None
        name = value.__name__ if issubclass(type(value), types.ModuleType) else ""
        nxt = _attribute(value, attr, name)
        if nxt is _MISSING:
            return _MISSING, f"{where}: `{path}.{attr}`: no such name"
        value, path = nxt, f"{path}.{attr}"
    return value, None


def _uses(tree: ast.AST, bound: dict[str, object], where: str) -> list[str]:
    problems: list[str] = []
    seen: set[str] = set()
    for node in ast.walk(tree):
        target = node.func if isinstance(node, ast.Call) else node
        if not isinstance(target, (ast.Attribute, ast.Name)):
            continue
        parts = _chain(target)
        if parts is None or parts[0] not in bound:
            continue
        value, problem = _resolve(parts, bound, where)
        if problem is not None and problem not in seen:
            seen.add(problem)
            problems.append(problem)
        if isinstance(node, ast.Call) and value is not _MISSING and _ours(value):
            problems += _keywords(value, node, ".".join(parts), where)
    return problems


def _ours(value: object) -> bool:
    module = getattr(value, "__module__", None) or ""
    return module.partition(".")[0] in OURS


def _keywords(func: object, call: ast.Call, name: str, where: str) -> list[str]:
    """The keywords ``call`` passes that ``func`` does not take."""
    try:
        sig = inspect.signature(func)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return []
    params = sig.parameters.values()
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return []
    names = {p.name for p in params if p.kind is not inspect.Parameter.POSITIONAL_ONLY}
    return [
        f"{where}: `{name}(...)` takes no keyword `{kw.arg}`"
        for kw in call.keywords
        if kw.arg is not None and kw.arg not in names
    ]


# --- shell -------------------------------------------------------------------------------------


def commands(code: str, console: bool) -> Iterator[list[str]]:
    """The simple commands of a shell block (a `console` block's are its `$ ` lines), as words,
    without the variables set before them."""
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
            while words and re.match(r"^[A-Za-z_][A-Za-z0-9_]*=", words[0]):
                words.pop(0)
            if words:
                yield words
            words = []
        else:
            words.append(tok)


def check_shell(code: str, where: str, console: bool = False) -> list[str]:
    problems: list[str] = []
    for words in commands(code, console):
        head = words[0]
        if head == "outbox-relay" or head.endswith("/outbox-relay"):
            problems += check_cli(words[1:], where)
        for word in words:
            if _REPO_PATH.match(word) and not (ROOT / word).exists():
                problems.append(f"{where}: `{word}` is not a file of the repository")
        if words[:2] == ["python", "manage.py"] and len(words) > 2:
            cmd = ROOT / "outbox" / "django" / "management" / "commands" / f"{words[2]}.py"
            if words[2].startswith("outbox") and not cmd.exists():
                problems.append(f"{where}: `manage.py {words[2]}`: no such command of ours")
    return problems


def check_cli(args: list[str], where: str) -> list[str]:
    """``outbox-relay ARGS``: each subcommand exists, each option is one of its command's."""
    from relay.cli import main

    cmd: click.Command = main
    path = "outbox-relay"
    i = 0
    while i < len(args):
        arg = args[i]
        if arg == "--":
            break
        if arg.startswith("-") and arg != "-":
            name = arg.split("=", 1)[0]
            opt = _option(cmd, name)
            if opt is None:
                return [f"{where}: `{path}` has no option {name}"]
            takes = not (opt.is_flag or opt.count) and "=" not in arg
            i += 1 + (opt.nargs if takes else 0)
            continue
        if isinstance(cmd, click.Group):
            sub = cmd.get_command(click.Context(cmd), arg)
            if sub is None:
                return [f"{where}: `{path}` has no command {arg}"]
            cmd, path = sub, f"{path} {arg}"
        i += 1
    return []


def _option(cmd: click.Command, name: str) -> click.Option | None:
    if name in ("--help", "-h"):
        return click.Option(["--help"], is_flag=True)
    for param in cmd.params:
        if isinstance(param, click.Option) and name in (*param.opts, *param.secondary_opts):
            return param
    return None


# --- TOML --------------------------------------------------------------------------------------


# The secrets a page tells readers to set in the environment, stood for while a fragment is
# checked (the webhooks' are, by the documenting context).
_PLACEHOLDERS = {
    "OUTBOX_UI_TOKEN": "docs-placeholder-token-0123456789",
    "OUTBOX_PORTAL_KEY": "opk_" + "A" * 43,
}


_UI_TOKENS = {"token", "token_file", "operators", "operators_file"}


def check_toml(code: str, where: str, workdir: Path) -> list[str]:
    """A relay configuration the relay accepts (its secrets stood for, as `catalog asyncapi`
    does, and a database URL given if the example leaves it to the environment)."""
    from relay.config.environment import documenting
    from relay.settings import ConfigError, load_settings

    try:
        data: dict[str, Any] = tomllib.loads(code)
    except tomllib.TOMLDecodeError as exc:
        return [f"{where}: not valid TOML: {exc}"]
    path = workdir / "fragment.toml"
    path.write_text(code)
    overrides = {} if "database_url" in data else {"database_url": "postgresql://docs@localhost/x"}
    token = documenting.set(True)
    ui = data.get("ui", {})
    # Operators sign in with their own tokens: a shared one stood for would be refused beside.
    stand_for = {
        k: v
        for k, v in _PLACEHOLDERS.items()
        if not (k == "OUTBOX_UI_TOKEN" and isinstance(ui, dict) and ui.keys() & _UI_TOKENS)
    }
    saved = {k: os.environ.get(k) for k in stand_for}
    os.environ.update({k: v for k, v in stand_for.items() if saved[k] is None})
    try:
        load_settings(path, **overrides)
    except ConfigError as exc:
        return [f"{where}: the relay refuses this configuration: {exc}"]
    finally:
        documenting.reset(token)
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
    return []


def check_syntax(lang: str, code: str, where: str) -> list[str]:
    """A `<!-- fragment: syntax -->`: one that names what only its reader has (a file of
    theirs, a secret), checked only to parse."""
    try:
        if lang in ("python", "py"):
            compile(code, where, "exec", ast.PyCF_ONLY_AST | ast.PyCF_ALLOW_TOP_LEVEL_AWAIT)
        elif lang == "toml":
            tomllib.loads(code)
    except (SyntaxError, tomllib.TOMLDecodeError) as exc:
        return [f"{where}: does not parse as {lang}: {exc}"]
    return []
