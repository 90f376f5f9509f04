"""The console's tokens: where they come from (``OUTBOX_UI_TOKEN`` or a file; operators from
``[ui] operators``, ``OUTBOX_UI_OPERATORS`` or an operators file) and what makes one usable.
Part of the configuration, which checks them at start-up; relay/ui/security.py uses them."""

from __future__ import annotations

import json
import os
import re
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

TOKEN_VARIABLE = "OUTBOX_UI_TOKEN"  # noqa: S105 - the variable's name
OPERATORS_VARIABLE = "OUTBOX_UI_OPERATORS"
MIN_TOKEN_CHARS = 16


class TokenError(Exception):
    """No usable token: the console refuses to start without one."""


def load_token(token_file: str | Path | None = None, environ: dict[str, str] | None = None) -> str:
    """The console's token, from ``token_file`` or ``OUTBOX_UI_TOKEN``."""
    env = os.environ if environ is None else environ
    if token_file is not None:
        try:
            token = Path(token_file).read_text(encoding="utf-8").strip()
        except OSError as exc:
            raise TokenError(f"cannot read the console's token file {token_file}: {exc}") from None
        where = f"the token file {token_file}"
    else:
        token = env.get(TOKEN_VARIABLE, "").strip()
        where = TOKEN_VARIABLE
    if not token:
        raise TokenError(
            f"the console needs a token: set {TOKEN_VARIABLE} (or --token-file) to a random "
            'value of at least 16 characters, e.g. `python -c "import secrets; '
            'print(secrets.token_urlsafe(32))"`'
        )
    if len(token) < MIN_TOKEN_CHARS:
        raise TokenError(
            f"{where} holds a token of {len(token)} characters; use at least {MIN_TOKEN_CHARS} "
            "random ones"
        )
    return token


# Operator names go into logs, paused_by and the skipped rows' errors as they are.
OPERATOR_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.@-]{0,63}")


def check_operators(operators: Mapping[str, str], where: str | None) -> dict[str, str]:
    """Operators and their tokens, checked: usable names, tokens of at least 16 characters,
    and no two operators with one token (the log could not tell them apart). ``where`` names
    the setting at the start of each error (None: the caller names it); a token is never
    quoted."""

    def refused(detail: str) -> TokenError:
        return TokenError(f"{where}: {detail}" if where else detail)

    if not operators:
        raise refused(
            "names no operator: give at least one (name = token), or leave it out to use the "
            f"shared token ({TOKEN_VARIABLE})"
        )
    checked: dict[str, str] = {}
    owners: dict[str, str] = {}
    for name, token in operators.items():
        if not isinstance(name, str) or not OPERATOR_NAME.fullmatch(name):
            raise refused(
                f"{name!r} is not a usable operator name: letters, digits and . _ @ -, "
                "starting with a letter or digit, at most 64"
            )
        if not isinstance(token, str):
            raise refused(f"the token of {name} must be a string")
        token = token.strip()
        if len(token) < MIN_TOKEN_CHARS:
            raise refused(
                f"the token of {name} has {len(token)} characters; use at least "
                f"{MIN_TOKEN_CHARS} random ones"
            )
        if token in owners:
            raise refused(
                f"{owners[token]} and {name} have the same token: give each operator their "
                "own, so that the log can tell who acted"
            )
        owners[token] = name
        checked[name] = token
    return checked


def load_operators(
    operators_file: str | Path | None = None, environ: Mapping[str, str] | None = None
) -> dict[str, str] | None:
    """The operators and their tokens, from ``operators_file`` (TOML, one ``name = "token"``
    line each) or ``OUTBOX_UI_OPERATORS`` (a JSON object); None when neither is set."""
    env = os.environ if environ is None else environ
    found: Any
    if operators_file is not None:
        where = f"the operators file {operators_file}"
        try:
            found = tomllib.loads(Path(operators_file).read_text(encoding="utf-8"))
        except OSError as exc:
            raise TokenError(f"cannot read {where}: {exc}") from None
        except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
            # The parser's message quotes no value, only where it stopped.
            raise TokenError(f'{where} is not TOML of name = "token" lines: {exc}') from None
    else:
        raw = env.get(OPERATORS_VARIABLE, "").strip()
        if not raw:
            return None
        where = OPERATORS_VARIABLE
        try:
            found = json.loads(raw)
        except ValueError:
            found = None
        if not isinstance(found, dict):
            raise TokenError(
                f"{where} must be a JSON object of operators and their tokens, e.g. "
                '{"alice": "…", "bob": "…"}'
            )
    return check_operators(found, where)
