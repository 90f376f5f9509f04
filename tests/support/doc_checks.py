"""What can be checked of an example the suite does not run (a `<!-- fragment -->` of a page):
its Python compiles, what it imports exists, the names it takes from our packages and the
keywords it passes them exist; its `outbox-relay` commands and their options exist, as do the
repository's scripts and files it names; its TOML is a relay configuration the relay accepts.
A fragment that names a function we renamed fails as a run example would.

Each check returns the problems it found, as lines that name the block's place."""

from __future__ import annotations

import ast
import collections
import contextlib
import functools
import importlib
import inspect
import os
import textwrap
import tomllib
import types
from pathlib import Path
from typing import Any

from tests.support import doc_shell

ROOT = Path(__file__).resolve().parent.parent.parent
# Our packages: what a page imports of them must exist. Another package need not be installed
# here (a page may show the CloudEvents SDK), but when it is, what the page takes of it must
# exist too.
OURS = ("outbox", "relay")
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
    _module_assignments(tree, bound)
    problems += _uses(tree, bound, where)
    return problems


_SCOPES = (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)


class _Instance:
    """What ``name = OurClass(...)`` binds: an instance, whose attributes are its class's and
    those its methods set on ``self``."""

    def __init__(self, cls: type) -> None:
        self.cls = cls


def _module_assignments(tree: ast.Module, bound: dict[str, object]) -> None:
    """A name the example assigns at module level is no longer the import's; an instance of a
    class of ours, if that is what it assigns (a function's own names are its own: _uses)."""
    made: dict[str, ast.Call] = {}
    stores: collections.Counter[str] = collections.Counter()
    for node in _walk_scope(tree):
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            bound.pop(node.id, None)
            stores[node.id] += 1
        if (
            isinstance(node, ast.Assign)
            and len(node.targets) == 1
            and isinstance(node.targets[0], ast.Name)
            and isinstance(node.value, ast.Call)
        ):
            made[node.targets[0].id] = node.value
    for name, call in made.items():
        cls, _, _ = _value(call.func, bound, "")
        # Assigned once: what it holds is known wherever it is read.
        if stores[name] == 1 and issubclass(type(cls), type) and _ours(cls):
            bound[name] = _Instance(cls)


def _walk_scope(node: ast.AST) -> list[ast.AST]:
    """The nodes of ``node``'s own scope: not those of the functions and classes in it."""
    found: list[ast.AST] = []
    for child in ast.iter_child_nodes(node):
        found.append(child)
        if not isinstance(child, _SCOPES):
            found += _walk_scope(child)
    return found


def _locals(scope: ast.AST) -> set[str]:
    """The names a function (or class body) binds: they hide the module's inside it."""
    names = {
        n.id for n in ast.walk(scope) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)
    }
    if isinstance(scope, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
        a = scope.args
        names |= {x.arg for x in [*a.posonlyargs, *a.args, *a.kwonlyargs, a.vararg, a.kwarg] if x}
    declared = {n for g in ast.walk(scope) if isinstance(g, ast.Global) for n in g.names}
    return names - declared


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


def _value(node: ast.expr, bound: dict[str, object], where: str) -> tuple[object, str, str | None]:
    """What ``node`` (``a.b.c``, or ``Cls(...).b``) names, its text, and a problem if a name
    along it is missing. Followed through modules, classes and instances of our classes;
    _MISSING where it is not known before the example runs."""
    if isinstance(node, ast.Name):
        return bound.get(node.id, _MISSING), node.id, None
    if isinstance(node, ast.Call):
        cls, path, problem = _value(node.func, bound, where)
        made = _Instance(cls) if issubclass(type(cls), type) and _ours(cls) else _MISSING
        return made, f"{path}(...)", problem
    if not isinstance(node, ast.Attribute):
        return _MISSING, "", None
    owner, path, problem = _value(node.value, bound, where)
    path = f"{path}.{node.attr}"
    if problem is not None or owner is _MISSING:
        return _MISSING, path, problem
    # type(): a lazy object (Django's settings) would set itself up for isinstance().
    if type(owner) is _Instance:
        nxt = _member(owner.cls, node.attr)
    elif issubclass(type(owner), (types.ModuleType, type)):
        name = owner.__name__ if issubclass(type(owner), types.ModuleType) else ""
        nxt = _attribute(owner, node.attr, name)
    else:
        return _MISSING, path, None
    if nxt is _MISSING:
        return _MISSING, path, f"{where}: `{path}`: no such name"
    return nxt, path, None


_ROUTINES = (
    types.FunctionType,
    types.MethodType,
    types.BuiltinFunctionType,
    functools.partial,
    type(functools.cache(len)),
)


class _Method:
    """A method of an instance of ours: called without its ``self``."""

    def __init__(self, func: object) -> None:
        self.func = func


_UNKNOWN = object()  # an attribute that exists, of a value not known before the example runs


def _member(cls: type, attr: str) -> object:
    static = inspect.getattr_static(cls, attr, _MISSING)
    if static is _MISSING:
        dynamic = inspect.getattr_static(cls, "__getattr__", None) is not None
        return _UNKNOWN if dynamic or attr in _instance_attributes(cls) else _MISSING
    if inspect.isfunction(static):
        return _Method(static)
    if isinstance(static, (staticmethod, classmethod)):
        return getattr(cls, attr)
    return _UNKNOWN


@functools.cache
def _instance_attributes(cls: type) -> frozenset[str]:
    """What the instances of ``cls`` hold beyond its class: its annotations, slots, and what its
    methods (and those of the classes it extends) set on ``self``."""
    names: set[str] = set()
    for klass in cls.__mro__:
        names |= set(getattr(klass, "__annotations__", {})) | set(getattr(klass, "__slots__", ()))
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
        except (OSError, TypeError, SyntaxError):
            continue
        names |= {
            n.attr
            for n in ast.walk(tree)
            if isinstance(n, ast.Attribute)
            and isinstance(n.ctx, ast.Store)
            and isinstance(n.value, ast.Name)
            and n.value.id == "self"
        }
    return frozenset(names)


def _uses(tree: ast.AST, bound: dict[str, object], where: str) -> list[str]:
    problems: list[str] = []
    seen: set[str] = set()

    def visit(node: ast.AST, scope: dict[str, object]) -> None:
        if isinstance(node, _SCOPES):
            hidden = _locals(node)
            scope = {k: v for k, v in scope.items() if k not in hidden}
        target = node.func if isinstance(node, ast.Call) else node
        if isinstance(target, (ast.Attribute, ast.Name)):
            value, path, problem = _value(target, scope, where)
            if problem is not None and problem not in seen:
                seen.add(problem)
                problems.append(problem)
            if isinstance(node, ast.Call) and value is not _MISSING:
                problems.extend(_arguments(value, node, path, where))
        for child in ast.iter_child_nodes(node):
            visit(child, scope)

    visit(tree, bound)
    return problems


def _ours(value: object) -> bool:
    if type(value) is _Method:
        value = value.func
    # Only functions and classes, told by their type: another object's attributes may run its
    # code (Django's lazy settings set themselves up).
    if not issubclass(type(value), (type, *_ROUTINES)):
        return False
    module = getattr(value, "__module__", None) or ""
    return module.partition(".")[0] in OURS


def _arguments(func: object, call: ast.Call, name: str, where: str) -> list[str]:
    """The keywords ``call`` passes that ``func`` (of ours) does not take, and its positional
    arguments past those it takes."""
    if not _ours(func):
        return []
    try:
        sig = inspect.signature(func.func if type(func) is _Method else func)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return []
    params = list(sig.parameters.values())[1 if type(func) is _Method else 0 :]
    kinds = {p.kind for p in params}
    problems = []
    if inspect.Parameter.VAR_KEYWORD not in kinds:
        names = {p.name for p in params if p.kind is not inspect.Parameter.POSITIONAL_ONLY}
        problems += [
            f"{where}: `{name}(...)` takes no keyword `{kw.arg}`"
            for kw in call.keywords
            if kw.arg is not None and kw.arg not in names
        ]
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    starred = any(isinstance(a, ast.Starred) for a in call.args)
    n = len(positional)
    if inspect.Parameter.VAR_POSITIONAL not in kinds and not starred and len(call.args) > n:
        problems.append(
            f"{where}: `{name}(...)` takes {n} positional argument{'' if n == 1 else 's'}, "
            f"not {len(call.args)}"
        )
    return problems


# --- shell: tests/support/doc_shell.py ----------------------------------------------------------

check_shell = doc_shell.check_shell
check_cli = doc_shell.check_cli
commands = doc_shell.commands


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
    # The page's configuration alone: the caller's OUTBOX_* variables would win over it (a
    # valid value hiding the page's invalid one) or fail it (a bad one of the caller's).
    saved = {k: v for k, v in os.environ.items() if k.startswith("OUTBOX_")}
    for k in saved:
        del os.environ[k]
    os.environ.update(stand_for)
    try:
        load_settings(path, **overrides)
    except ConfigError as exc:
        return [f"{where}: the relay refuses this configuration: {exc}"]
    finally:
        documenting.reset(token)
        for k in stand_for:
            os.environ.pop(k, None)
        os.environ.update(saved)
    return []


def check_syntax(lang: str, code: str, where: str) -> list[str]:
    """A `<!-- fragment: syntax -->`: one that names what only its reader has (a file of
    theirs, a secret), checked only to parse."""
    if lang == "sh":
        return doc_shell.check_syntax(code, where)
    try:
        if lang in ("python", "py"):
            compile(code, where, "exec", ast.PyCF_ONLY_AST | ast.PyCF_ALLOW_TOP_LEVEL_AWAIT)
        elif lang == "toml":
            tomllib.loads(code)
    except (SyntaxError, tomllib.TOMLDecodeError) as exc:
        return [f"{where}: does not parse as {lang}: {exc}"]
    return []
