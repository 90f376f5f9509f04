"""``outbox-relay catalog``: the application's event catalog (``outbox.catalog``) exported,
published as an AsyncAPI document, and checked against the previous release (docs/catalog.md).

None of these commands needs the database or the webhook secrets: they run in CI."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from relay.cli.options import EXIT_CONDITION
from relay.cli.render import echo, echo_exact, echo_json, echo_lines

if TYPE_CHECKING:
    from outbox.catalog import Catalog
    from relay.catalog.view import CatalogView
    from relay.config.settings import Settings

SOURCE_VARIABLE = "OUTBOX_CATALOG_SOURCE"

# A URL the documenting commands put in place of the database's: the document never names it,
# and nothing connects to it.
_NO_DATABASE = "postgresql://documenting@localhost/none"

catalog_option = click.option(
    "--catalog",
    "spec",
    envvar=SOURCE_VARIABLE,
    show_envvar=True,
    metavar="SPEC",
    help="The catalog: module:attr (imported; the working directory first on the path) or a "
    "catalog.json written by `catalog export`. Default: catalog.source of --config.",
)
_config_option = click.option(
    "--config",
    type=click.Path(dir_okay=False, path_type=Path),
    envvar="OUTBOX_CONFIG",
    show_envvar=True,
    help="The relay's relay.toml: its destinations are the document's channels. Read without "
    "the database; a secret_env that is not set stands for a placeholder.",
)
_output_option = click.option(
    "-o",
    "--output",
    type=click.Path(dir_okay=False, path_type=Path),
    help="Write to this file instead of stdout.",
)


@click.group(short_help="Export, publish (AsyncAPI) and check the event catalog.")
def catalog() -> None:
    """The event types the application declares with ``outbox.catalog``: exported for a relay
    deployed apart from the application's code, published as an AsyncAPI 3.0 document, and
    compared with the previous release's document (exit 3 on a change that breaks consumers)."""


@catalog.command(short_help="Write the catalog as JSON, for a relay without the app's code.")
@catalog_option
@_config_option
@_output_option
def export(spec: str | None, config: Path | None, output: Path | None) -> None:
    """The catalog as JSON (``format: outbox-catalog/1``): what ``--catalog catalog.json`` and
    ``[catalog] source`` read, with no application code or pydantic needed."""
    settings = _settings(config) if config is not None else None
    found = _catalog(spec, settings)
    _write(json.dumps(found.export(), indent=2, sort_keys=True, ensure_ascii=False) + "\n", output)


@catalog.command(short_help="Write the AsyncAPI 3.0 document of the catalog and the relay.")
@catalog_option
@_config_option
@_output_option
def asyncapi(spec: str | None, config: Path | None, output: Path | None) -> None:
    """An AsyncAPI 3.0 document: a channel per destination of --config (a Kafka topic with its
    key, a webhook, an endpoints destination), a message per event type it carries with the
    type's schema, the headers every message carries and the Standard Webhooks signature.
    Deterministic: commit it and diff it."""
    from relay.catalog.asyncapi import build, render

    if config is None:
        raise click.UsageError("say which relay: --config relay.toml (its destinations)")
    settings = _settings(config)
    found = _catalog(spec, settings)
    document = build(
        found.export(),
        settings,
        kafka_host=settings.catalog.kafka_host,
        webhook_paths=settings.catalog.webhook_paths,
    )
    _write(render(document), output)


@catalog.command(short_help="Check the catalog, and compare it with a previous release's.")
@catalog_option
@_config_option
@click.option(
    "--against",
    type=click.Path(dir_okay=False, exists=True, path_type=Path),
    help="The previous release's AsyncAPI document (from `catalog asyncapi`) or export.",
)
@click.option(
    "--allow",
    "allowed",
    multiple=True,
    metavar="TYPE",
    help="An event type whose breaking changes are intended (repeat).",
)
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of lines.")
def check(
    spec: str | None,
    config: Path | None,
    against: Path | None,
    allowed: tuple[str, ...],
    as_json: bool,
) -> None:
    """The catalog's own problems (a type on a destination the configuration lacks, a type
    name CloudEvents refuses, a channel carrying several types no header tells apart), then,
    with --against, every change from the previous release: BREAKING where old events no
    longer fit the new schema or new events the old one (a tolerant reader ignores new
    optional fields and enum values). Exits 3 if a breaking change is not --allow'ed, 1 if the
    catalog has a problem (1 wins: fix the catalog first), 0 otherwise."""
    from relay.catalog.checks import problems
    from relay.catalog.documents import read_previous

    settings = _settings(config) if config is not None else None
    found = _catalog(spec, settings).export()
    notes = problems(found, settings)
    changes: list[Any] = []
    if against is not None:
        from outbox.catalog.compat import compare

        try:
            previous = read_previous(against)
        except ValueError as exc:
            raise click.BadParameter(str(exc), param_hint="'--against'") from None
        try:
            changes = compare(previous, found)
        except ValueError as exc:
            raise click.UsageError(str(exc)) from None
    breaking = [c for c in changes if c.verdict == "breaking" and c.type not in allowed]
    if as_json:
        out = {
            "problems": [{"level": level, "message": text} for level, text in notes],
            "changes": [_change_json(c, allowed) for c in sorted(changes)],
            "breaking": len(breaking),
        }
        echo_json(out)
    else:
        for level, text in notes:
            echo_lines(f"{level.upper()} {text}", err=True)
        for c in sorted(changes):
            mark = " (allowed)" if c.verdict == "breaking" and c.type in allowed else ""
            echo(f"{c}{mark}")  # one line: a line break in a name the schema gave is escaped
        if not changes and against is not None:
            echo(f"no change against {against}")
    if any(level == "error" for level, _ in notes):
        sys.exit(1)
    if breaking:
        sys.exit(EXIT_CONDITION)


def _change_json(c: Any, allowed: tuple[str, ...]) -> dict[str, Any]:
    return {
        "type": c.type,
        "path": c.path,
        "rule": c.rule,
        "verdict": c.verdict,
        "detail": c.detail,
        "allowed": c.verdict == "breaking" and c.type in allowed,
    }


def _write(text: str, output: Path | None) -> None:
    if output is None:
        echo_exact(text.removesuffix("\n"))  # JSON for another program: exactly as written
        return
    try:
        output.write_text(text, encoding="utf-8")
    except OSError as exc:
        raise click.ClickException(f"cannot write {output}: {exc.strerror}") from None


@contextmanager
def _documenting() -> Iterator[None]:
    from relay.config.environment import documenting

    token = documenting.set(True)
    try:
        yield
    finally:
        documenting.reset(token)


def _settings(config: Path) -> Settings:
    """The relay's configuration, read to document it: no database, and a placeholder for a
    webhook secret the environment does not hold (relay.config.environment.documenting)."""
    from relay.cli.options import _load_config

    with _documenting():
        return _load_config(config, _NO_DATABASE)


def served_catalog(spec: str | None) -> CatalogView | None:
    """For ``ui`` and ``portal``: the catalog of ``--catalog``, else the ``[catalog] source``
    of ``--config`` (None: neither names one), with the AsyncAPI document of ``--config`` as
    ``catalog asyncapi`` makes it. One that fails to load is logged, not fatal, as in the
    relay (relay.catalog.view.load_view)."""
    from relay.catalog.view import load_view

    config = click.get_current_context().params.get("config")
    settings = _settings(config) if config is not None else None
    return load_view(spec, settings)


def _catalog(spec: str | None, settings: Settings | None) -> Catalog:
    """The catalog ``spec`` names, else the configuration's ``[catalog] source``; exit 2 with
    what went wrong (the module, the attribute, the file) if it cannot be loaded."""
    from outbox.catalog import load_catalog

    if spec is None and settings is not None:
        spec = settings.catalog.source
    if spec is None:
        raise click.UsageError(
            f"say which catalog: --catalog module:attr or catalog.json, {SOURCE_VARIABLE}, or "
            "[catalog] source in --config"
        )
    if str(Path.cwd()) not in sys.path and "" not in sys.path:
        sys.path.insert(0, str(Path.cwd()))  # as `python -m` would: the application's modules
    try:
        return load_catalog(spec)
    except Exception as exc:  # the application's module may raise anything
        echo_lines(f"outbox-relay: cannot load the catalog {spec!r}: {_reason(exc)}", err=True)
        sys.exit(2)


def _reason(exc: BaseException) -> str:
    text = str(exc) or type(exc).__name__
    return (
        text
        if isinstance(exc, (ValueError, LookupError, OSError))
        else f"{type(exc).__name__}: {text}"
    )
