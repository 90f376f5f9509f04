"""The documentation: README.md is a front page, docs/configuration.md is what
scripts/gen_config_docs.py writes from the settings models and names every setting, and no
relative link of README.md or docs/ leads nowhere."""

from __future__ import annotations

import importlib.util
import re
import sys
from collections.abc import Iterable, Mapping
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from pydantic import BaseModel, Field

from relay.config.base import DestinationSettings
from relay.settings import settings_model
from relay.sinks import Sink, SinkKind
from relay.sinks.registry import KINDS

ROOT = Path(__file__).parent.parent
README = ROOT / "README.md"
DOCS = ROOT / "docs"
REFERENCE = DOCS / "configuration.md"


def generator() -> ModuleType:
    """scripts/gen_config_docs.py, imported."""
    name = "gen_config_docs"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # its dataclasses look themselves up there
        spec.loader.exec_module(module)
    return sys.modules[name]


# --- the configuration reference ------------------------------------------------------------


def test_the_configuration_reference_is_what_the_models_say() -> None:
    expected = generator().render()
    assert REFERENCE.read_text() == expected, (
        "docs/configuration.md is out of date: run .venv/bin/python scripts/gen_config_docs.py"
    )


def model_of(annotation: object) -> type[BaseModel] | None:
    return (
        annotation if isinstance(annotation, type) and issubclass(annotation, BaseModel) else None
    )


def keys(model: type[BaseModel], prefix: str) -> list[str]:
    """The settings of ``model``: its fields, without the sections (tables) it contains,
    which are checked key by key on their own."""
    out = []
    for name, f in model.model_fields.items():
        if model_of(f.annotation) is not None:
            continue  # a section such as relay.backoff
        if name == "destinations":
            continue  # a table of destinations, each documented key by key
        out.append(f"{prefix}{f.alias or name}")
    return out


def section_keys(model: type[BaseModel], prefix: str, seen: set[type[BaseModel]]) -> list[str]:
    """``keys``, and those of the sections inside ``model``. A section whose model has a
    table already (a webhook destination's backoff is relay.backoff's) is one key."""
    seen.add(model)
    out = keys(model, prefix)
    for name, f in model.model_fields.items():
        inner = model_of(f.annotation)
        if inner is None:
            continue
        key = f"{prefix}{f.alias or name}"
        out += [key] if inner in seen else section_keys(inner, f"{key}.", seen)
    return out


def every_setting() -> list[str]:
    """Every key the relay accepts, its sinks' included, from the models and the registry."""
    seen: set[type[BaseModel]] = set()
    expected = section_keys(settings_model(), "", seen)
    expected += section_keys(DestinationSettings, "destinations.NAME.", seen)
    for kind in KINDS.values():
        expected += section_keys(kind.destination, "destinations.NAME.", seen)
    return list(dict.fromkeys(expected))


def test_every_setting_is_in_the_configuration_reference() -> None:
    expected = every_setting()
    for key in (
        "database_url",
        "relay.lease",
        "relay.backoff.schedule",
        "http.port",
        "kafka.bootstrap_servers",
        "webhooks.max_connections",
        "destinations.NAME.kind",
        "destinations.NAME.topic",
        "destinations.NAME.backoff",
        "destinations.NAME.circuit.threshold",
    ):
        assert key in expected, key
    # A table is not a key of its own where it is first met (an endpoints destination's
    # `circuit` row points at the webhook kind's table, as `backoff` rows point at relay's).
    assert "relay.backoff" not in expected and "destinations.NAME.circuit.cooldown" in expected
    # Each key in backticks, as the reference tables write them: a key that merely appears
    # inside another word or sentence does not count.
    text = REFERENCE.read_text()
    missing = [k for k in expected if f"`{k}`" not in text]
    assert not missing, f"docs/configuration.md lacks: {missing}"


def no_sink(section: Any, destinations: Mapping[str, Any]) -> Sink:
    raise AssertionError("the reference never builds a sink")


def test_a_new_kind_of_sink_is_documented_and_an_undocumented_setting_stops_the_generator(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    gen = generator()

    class SmokeDestination(DestinationSettings):
        channel: str = Field("general", description="the channel the smoke signals go up in")

    smoke = SinkKind(name="smoke", destination=SmokeDestination, build=no_sink)
    monkeypatch.setattr(gen, "KINDS", {**KINDS, "smoke": smoke})
    text = gen.render()
    assert "### Destinations of kind `smoke`" in text
    assert "| `destinations.NAME.channel` | string | `general` |" in text

    class QuietDestination(DestinationSettings):
        volume: int = 3

    quiet = SinkKind(name="quiet", destination=QuietDestination, build=no_sink)
    monkeypatch.setattr(gen, "KINDS", {**KINDS, "quiet": quiet})
    with pytest.raises(gen.UndocumentedSettings, match=r"destinations\.NAME\.volume"):
        gen.render()


# --- the front page -------------------------------------------------------------------------


def test_the_readme_is_a_front_page() -> None:
    lines = len(README.read_text().splitlines())
    assert lines <= 200, f"README.md has {lines} lines: move the details to docs/"


def test_readme_names_the_two_commands_and_ci_runs_the_test_one() -> None:
    readme = README.read_text()
    assert "./scripts/demo" in readme and "./scripts/test" in readme
    ci = (ROOT / ".ci" / "run").read_text()
    assert "./scripts/test" in ci


# --- links ----------------------------------------------------------------------------------

_FENCE = re.compile(r"^(```|~~~).*?^\1[ \t]*$", re.M | re.S)
_CODE = re.compile(r"(`+)(?!`).*?(?<!`)\1(?!`)", re.S)
_LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_HEADING = re.compile(r"^ {0,3}(#{1,6})[ \t]+(.+?)[ \t#]*$", re.M)


def without_code(text: str) -> str:
    """Markdown without fenced blocks and code spans, where nothing is a link or a heading."""
    return _CODE.sub("", _FENCE.sub("", text))


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation but '-' and '_' dropped, each
    space a '-'."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """The anchors GitHub gives the headings of ``path`` (a repeated one gets -1, -2, …)."""
    found: set[str] = set()
    counts: dict[str, int] = {}
    for match in _HEADING.finditer(_FENCE.sub("", path.read_text())):
        base = slug(match.group(2))
        n = counts.get(base, 0)
        counts[base] = n + 1
        found.add(base if n == 0 else f"{base}-{n}")
    return found


def broken_links(files: Iterable[Path]) -> list[str]:
    problems = []
    for path in files:
        for target in _LINK.findall(without_code(path.read_text())):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I):
                continue  # https:, mailto:, …: not ours to check
            file, _, anchor = target.partition("#")
            dest = (path.parent / file).resolve() if file else path
            where = f"{path.relative_to(ROOT) if path.is_relative_to(ROOT) else path}"
            if not dest.exists():
                problems.append(f"{where}: {target}: no such file")
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                problems.append(f"{where}: {target}: no such heading in {dest.name}")
    return problems


def documentation() -> list[Path]:
    return [README, *sorted(DOCS.glob("*.md"))]


def test_every_relative_link_leads_to_a_file_and_heading() -> None:
    files = documentation()
    assert len(files) > 5, files
    problems = broken_links(files)
    assert not problems, "broken links:\n" + "\n".join(problems)


def test_the_link_check_finds_what_is_broken(tmp_path: Path) -> None:
    (tmp_path / "b.md").write_text("# The `[relay]` section: sizes & more\n\n## Again\n## Again\n")
    page = tmp_path / "a.md"
    page.write_text(
        "[ok](b.md) [ok](b.md#the-relay-section-sizes--more) [ok](b.md#again-1) [ok](#top)\n"
        "# Top\n"
        "[gone](c.md) [bad anchor](b.md#again-2) [self](#nowhere) [web](https://example.com/x)\n"
        "`[in code](d.md)`\n```\n[in a block](e.md)\n# not a heading\n```\n"
    )
    assert broken_links([page]) == [
        f"{page}: c.md: no such file",
        f"{page}: b.md#again-2: no such heading in b.md",
        f"{page}: #nowhere: no such heading in a.md",
    ]


# --- the package table of docs/architecture.md ----------------------------------------------


def package_table() -> ModuleType:
    """scripts/gen_package_table.py, imported."""
    spec = importlib.util.spec_from_file_location(
        "gen_package_table", ROOT / "scripts" / "gen_package_table.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_architecture_page_lists_every_package_as_its_docstring_says() -> None:
    gen = package_table()
    page = (DOCS / "architecture.md").read_text()
    assert gen.render(page) == page, "run: .venv/bin/python scripts/gen_package_table.py"
    for package in ("relay/pipeline/", "relay/db/", "relay/sinks/webhook/", "outbox/webhooks/"):
        assert f"| `{package}` |" in page


def test_a_new_package_without_a_docstring_stops_the_table(tmp_path: Path) -> None:
    gen = package_table()
    (tmp_path / "outbox").mkdir()
    (tmp_path / "outbox" / "__init__.py").write_text('"""The library. More."""\n')
    (tmp_path / "relay" / "fresh").mkdir(parents=True)
    (tmp_path / "relay" / "__init__.py").write_text('"""The relay: it relays."""\n')
    (tmp_path / "relay" / "fresh" / "__init__.py").write_text("")
    gen.ROOT = tmp_path
    with pytest.raises(SystemExit, match="relay/fresh/"):
        gen.table()
    (tmp_path / "relay" / "fresh" / "__init__.py").write_text('"""Fresh: new things.\n\nMore."""')
    assert gen.table().splitlines()[2:] == [
        "| `outbox/` | The library. |",
        "| `relay/` | The relay: it relays. |",
        "| `relay/fresh/` | Fresh: new things. |",
    ]
