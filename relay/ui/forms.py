"""What the console's actions share: the form they read, the question asked before one (its
preview, carrying the selection of rows it counted, signed, relay/ops/selection.py) and the
way back after it, logged as ``relay.console.action`` with the operator."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta
from typing import Any
from urllib.parse import parse_qs, quote

import structlog
from starlette.requests import Request
from starlette.responses import RedirectResponse, Response

from relay.ops.common import AdminError
from relay.ops.selection import Selection
from relay.ui.pages import caller_of, console_of
from relay.ui.security import CSRF_FIELD, Who

log = structlog.get_logger("relay.console")

Form = dict[str, str]

# Fields of a confirmation form that are not the action's own: the selection is checked
# against the others, which must be those the preview was made for.
NOT_THE_ACTIONS = frozenset({CSRF_FIELD, "confirm", "selection", "next"})


async def read_form(request: Request) -> Form:
    """An urlencoded form (the console sends no other), one value per field; text with NUL
    characters (which PostgreSQL text cannot hold) is refused here, with the field named."""
    body = await request.body()  # the gate caps its size
    fields = parse_qs(body.decode("utf-8", "replace"), keep_blank_values=True)
    form = {k: v[-1] for k, v in fields.items()}
    for name, value in form.items():
        if "\x00" in value:
            raise AdminError(f"{name} holds a NUL character")
    return form


def local_target(base: str, target: str | None) -> str:
    """Where to go after an action: a path of this console only (never another site)."""
    if target and target.startswith(base + "/") and not target.startswith("//"):
        return target
    return base + "/"


def who_of(request: Request) -> Who:
    caller = caller_of(request)
    assert caller is not None  # the gate let only those signed in through
    return caller.who


def finish(request: Request, form: Form, message: str, **target: Any) -> Response:
    """After an action: the audit log's line, and back to the page it came from with what
    happened (signed)."""
    log.info(
        "relay.console.action",
        action=request.path_params["name"],
        operator=who_of(request).operator,
        done=message,
        **target,
    )
    base = request.scope.get("root_path", "")
    target_url = local_target(base, form.get("next"))
    sep = "&" if "?" in target_url else "?"
    sig = console_of(request).guard.sign(message)
    return RedirectResponse(f"{target_url}{sep}msg={quote(message)}&sig={sig}", status_code=303)


def ids_of(form: Form) -> list[int]:
    raw = form.get("ids", "").replace(",", " ").split()
    if not raw or not all(whole(x) is not None for x in raw):
        raise AdminError("give the row ids, separated by spaces or commas")
    return sorted({int(x) for x in raw})


MAX_ID = 2**63 - 1


def whole(text: str | None) -> int | None:
    """A positive id as PostgreSQL's bigint holds it, or None."""
    if not text or not (text.isascii() and text.isdigit()):
        return None
    value = int(text)
    return value if 0 < value <= MAX_ID else None


def confirmed(form: Form) -> bool:
    return form.get("confirm") == "yes"


def own_fields(form: Form) -> Form:
    return {k: v for k, v in form.items() if k not in NOT_THE_ACTIONS}


def ask(
    request: Request, form: Form, title: str, lines: list[str], rows: int | None = None
) -> Response:
    """The question before an action: what it will do (on ``rows`` named rows, or on one
    thing), and a form to confirm with the same fields."""
    return console_of(request).render(
        request,
        "confirm.html",
        title=title,
        lines=lines,
        rows=rows,
        action=request.path_params["name"],
        fields={k: v for k, v in form.items() if k not in (CSRF_FIELD, "confirm")},
        back=local_target(request.scope.get("root_path", ""), form.get("next")),
    )


def preview_form(
    request: Request,
    form: Form,
    title: str,
    lines: list[str],
    selection: Selection,
    changed: str | None = None,
) -> Response:
    """The dry run's counts and a form to confirm with the same fields and the selection of
    rows it counted (signed together); ``changed``: why an earlier confirmation was refused
    (409), this being the preview as things are now."""
    fields = {k: v for k, v in form.items() if k not in (CSRF_FIELD, "confirm", "selection")}
    fields["selection"] = _seal(request, own_fields(fields), selection)
    return console_of(request).render(
        request,
        "confirm.html",
        status_code=409 if changed else 200,
        title=title,
        lines=lines,
        rows=selection.rows,
        changed=changed,
        action=request.path_params["name"],
        fields=fields,
        back=local_target(request.scope.get("root_path", ""), form.get("next")),
    )


EPOCH = datetime(1970, 1, 1, tzinfo=UTC)


def _seal(request: Request, fields: Form, selection: Selection) -> str:
    """The selection as a form field: its numbers, and a signature over them, the action
    and its fields (a selection cannot be moved to another filter or action, nor edited)."""
    at = (selection.at - EPOCH) // timedelta(microseconds=1)
    text = f"{selection.rows}.{selection.max_id}.{selection.digest}.{at}"
    return f"{text}.{console_of(request).guard.seal(_purpose(request, fields), text)}"


def _purpose(request: Request, fields: Form) -> str:
    listed = json.dumps(sorted(fields.items()), ensure_ascii=True)
    return f"selection:{request.path_params['name']}:{listed}"


def selection_of(request: Request, form: Form) -> Selection:
    """The selection a confirmation carries, checked against its signature."""
    sealed = form.get("selection", "")
    if not sealed:
        raise AdminError(
            "this confirmation carries no selection of rows: confirm with the form of the "
            "preview (it says which rows it counted), or preview again"
        )
    text, _, signature = sealed.rpartition(".")
    parts = text.split(".")
    wrong = AdminError(
        "this confirmation does not match its preview (edited, or made for other fields): "
        "preview again"
    )
    if len(parts) != 4 or not console_of(request).guard.sealed(
        _purpose(request, own_fields(form)), text, signature
    ):
        raise wrong
    try:
        rows, max_id, digest, at = (int(p) for p in parts)
    except ValueError:
        raise wrong from None
    return Selection(rows, max_id, digest, EPOCH + timedelta(microseconds=at))
