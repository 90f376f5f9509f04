"""No module over 500 lines and no function over 60 in `outbox/` and `relay/` (issue #28): what
is over today is listed with its size, which it may not outgrow; an entry goes when its module
or function is back under the limit (the lists only shrink), and nothing new joins them."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODULE_LINES = 500
FUNCTION_LINES = 60

# Every module is under the limit; an entry may not come back.
LONG_MODULES: dict[str, int] = {}
# Every function is under the limit; an entry may not come back.
LONG_FUNCTIONS: dict[str, int] = {}


def sources() -> list[Path]:
    return sorted(p for d in ("outbox", "relay") for p in (ROOT / d).rglob("*.py"))


def functions(path: Path) -> dict[str, int]:
    """Every function and method of ``path`` by qualified name, with its length in lines:
    wherever it is defined (under an ``if``, a ``try``, a ``with``, in another function), and
    the longest where two share a name (a property and its setter)."""
    found: dict[str, int] = {}

    def walk(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
                assert child.end_lineno is not None
                name = prefix + child.name
                found[name] = max(found.get(name, 0), child.end_lineno - child.lineno + 1)
                walk(child, name + ".")
            elif isinstance(child, ast.ClassDef):
                walk(child, prefix + child.name + ".")
            else:
                walk(child, prefix)

    walk(ast.parse(path.read_text()), "")
    return found


def over(limit: int, sizes: dict[str, int], allowed: dict[str, int]) -> list[str]:
    """What breaks the rule: over the limit and not listed, or grown past its listed size;
    listed while no longer over the limit (take it off the list), or listed above its size
    (lower the figure: the lists only shrink)."""
    problems = [
        f"{name}: {n} lines (the limit is {limit})"
        for name, n in sizes.items()
        if n > limit and n > allowed.get(name, limit)
    ]
    for name, cap in allowed.items():
        n = sizes.get(name, 0)
        if n <= limit:
            problems.append(f"{name}: listed at {cap} lines, now {n}: take it off the list")
        elif n < cap:
            problems.append(f"{name}: listed at {cap} lines, now {n}: list it at {n}")
    return sorted(problems)


def test_no_module_grows_past_the_limit() -> None:
    sizes = {str(p.relative_to(ROOT)): len(p.read_text().splitlines()) for p in sources()}
    assert not over(MODULE_LINES, sizes, LONG_MODULES)


def test_no_function_grows_past_the_limit() -> None:
    sizes = {
        f"{p.relative_to(ROOT)}:{name}": n for p in sources() for name, n in functions(p).items()
    }
    assert not over(FUNCTION_LINES, sizes, LONG_FUNCTIONS)


def test_the_check_finds_what_it_is_for() -> None:
    assert over(60, {"a.py:f": 61}, {}) == ["a.py:f: 61 lines (the limit is 60)"]
    assert over(60, {"a.py:f": 70}, {"a.py:f": 69}) == ["a.py:f: 70 lines (the limit is 60)"]
    assert over(60, {"a.py:f": 69}, {"a.py:f": 69}) == []
    assert over(60, {"a.py:f": 60}, {"a.py:f": 69}) == [
        "a.py:f: listed at 69 lines, now 60: take it off the list"
    ]
    assert over(60, {}, {"gone.py:f": 69}) == [
        "gone.py:f: listed at 69 lines, now 0: take it off the list"
    ]
    assert over(60, {"a.py:f": 65}, {"a.py:f": 69}) == [
        "a.py:f: listed at 69 lines, now 65: list it at 65"
    ]


def test_every_function_is_measured_wherever_it_stands(tmp_path: Path) -> None:
    body = "\n".join(f"    x{i} = {i}" for i in range(70))
    source = tmp_path / "m.py"
    source.write_text(
        "import sys\n"
        "if sys.platform:\n"
        f"    def hidden():\n    {body.replace(chr(10), chr(10) + '    ')}\n"
        "class C:\n"
        "    @property\n"
        f"    def p(self):\n    {body.replace(chr(10), chr(10) + '    ')}\n"
        "    @p.setter\n"
        "    def p(self, v):\n"
        "        pass\n"
        "try:\n"
        "    def t(): pass\n"
        "except ImportError:\n"
        "    pass\n"
    )
    found = functions(source)
    assert found["hidden"] > 60 and found["C.p"] > 60 and found["t"] == 1
