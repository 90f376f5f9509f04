"""The ``outbox-relay`` command.

Each command lives in a module of this package and is imported only when it runs (or when
``--help`` lists it): ``outbox-relay status`` does not load the relay, aiokafka or the
benchmark.
"""

from __future__ import annotations

import importlib
import traceback
from typing import Any

import click

from relay.obs import scrub

# Command name -> "module:attribute".
COMMANDS = {
    "migrate": "relay.cli.run:migrate",
    "run": "relay.cli.run:run",
    "status": "relay.cli.ops.status:status",
    "show": "relay.cli.ops.rows:show",
    "list": "relay.cli.ops.rows:list_",
    "retry": "relay.cli.ops.changes:retry",
    "replay": "relay.cli.ops.replay:replay",
    "purge": "relay.cli.ops.changes:purge",
    "pause": "relay.cli.ops.changes:pause",
    "resume": "relay.cli.ops.changes:resume",
    "skip": "relay.cli.ops.changes:skip",
    "endpoints": "relay.cli.endpoints:endpoints",
    "ui": "relay.cli.ui:ui",
    "portal": "relay.cli.portal:portal",
    "catalog": "relay.cli.catalog:catalog",
    "demo": "relay.cli.tools:demo",
    "init": "relay.cli.init:init",
    "bench": "relay.tools.bench.cli:bench",
}


class Commands(click.Group):
    """The commands of COMMANDS, each imported when it is first needed.

    Every command's error output passes through relay.obs.scrub.scrub: a usage or database
    error's message, and the traceback of an error nothing expected. The secrets a command
    registered are forgotten when it ends. The messages are escaped as all text output is
    (relay.cli.render.printable): they may quote the database's text."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(COMMANDS)

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        target = COMMANDS.get(cmd_name)
        if target is None:
            return None
        module, _, attr = target.partition(":")
        command = getattr(importlib.import_module(module), attr)
        assert isinstance(command, click.Command), target
        return command

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except click.ClickException as exc:
            raise _reworded(exc) from None
        except (click.exceptions.Exit, click.Abort):
            raise
        except Exception as exc:
            from relay.cli.render import echo_lines

            text = "".join(traceback.format_exception(exc))
            echo_lines(scrub.scrub(text).rstrip("\n"), err=True)
            ctx.exit(1)
        finally:
            scrub.reset()


def _reworded(exc: click.ClickException) -> click.ClickException:
    """``exc`` as it is shown, with its secrets hidden and escaped (relay.cli.render.printable:
    click quotes the values it names itself, but our messages may name the database's text);
    ``exc`` itself if that changes nothing."""
    from relay.cli.render import printable

    message = exc.format_message()  # a BadParameter's "Invalid value for …" included
    shown = printable(scrub.scrub(message))
    if shown == message:
        return exc
    if isinstance(exc, click.UsageError):
        return click.UsageError(shown, exc.ctx)
    return click.ClickException(shown)


def _colour(ctx: click.Context, param: click.Parameter, value: bool | None) -> None:
    # The command's context inherits it; relay.cli.render.colour_wanted reads it.
    if value is not None:
        ctx.color = value


@click.group(cls=Commands, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="outbox-relay")
@click.option(
    "--color/--no-color",
    default=None,
    expose_value=False,
    callback=_colour,
    help="Colour states in text output, even off a terminal; or never. Default: on a "
    "terminal, unless NO_COLOR is set.",
)
def main() -> None:
    """outbox-relay: a transactional outbox for PostgreSQL, relayed to Kafka and webhooks.

    Shell completion: eval "$(_OUTBOX_RELAY_COMPLETE=bash_source outbox-relay)" in
    ~/.bashrc (zsh_source in ~/.zshrc; fish_source for fish). See docs/operations.md."""
