"""The console's actions: sign-in, and what operators do to rows, destinations and endpoints.

Each action is the operations command's function (relay/ops/admin.py, outbox.endpoints),
with its checks and refusals. None acts on the first click: those that change or delete many
rows (retry, skip, purge, a replay of an endpoint's window) first show a preview with the
counts of a dry run, and its confirmation acts on exactly the rows it counted or refuses
(the form carries their selection, signed); pausing, disabling an endpoint, rotating its
secret and replaying one event first say what they will do. The confirmation is a field the
server checks, so a form posted without it only ever gets the question. Every action is
refused in read-only mode, and without the session's CSRF value and a same-origin request
(see security.py); each one done is logged as ``relay.console.action``, with the operator.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime, timedelta
from typing import Any
from urllib.parse import parse_qs, quote

import asyncpg
import structlog
from starlette.requests import Request
from starlette.responses import RedirectResponse, Response

from outbox.errors import OutboxError, describe
from relay.db.queries import render_ops
from relay.durations import parse_duration
from relay.ops import admin
from relay.ops.admin import AdminError, RetryFilter, Selection, SelectionChanged
from relay.ui import queries
from relay.ui.pages import caller_of, console_of
from relay.ui.security import CSRF_FIELD, SESSION_SECONDS, Who, cookie_name

log = structlog.get_logger("relay.console")

PURGE_BATCH = 5000

Form = dict[str, str]

# Fields of a confirmation form that are not the action's own: the selection is checked
# against the others, which must be those the preview was made for.
NOT_THE_ACTIONS = frozenset({CSRF_FIELD, "confirm", "selection", "next"})


async def _form(request: Request) -> Form:
    """An urlencoded form (the console sends no other), one value per field; text with NUL
    characters (which PostgreSQL text cannot hold) is refused here, with the field named."""
    body = await request.body()  # the gate caps its size
    fields = parse_qs(body.decode("utf-8", "replace"), keep_blank_values=True)
    form = {k: v[-1] for k, v in fields.items()}
    for name, value in form.items():
        if "\x00" in value:
            raise AdminError(f"{name} holds a NUL character")
    return form


def _local(base: str, target: str | None) -> str:
    """Where to go after an action: a path of this console only (never another site)."""
    if target and target.startswith(base + "/") and not target.startswith("//"):
        return target
    return base + "/"


def _who(request: Request) -> Who:
    caller = caller_of(request)
    assert caller is not None  # the gate let only those signed in through
    return caller.who


def _done(request: Request, form: Form, message: str, **target: Any) -> Response:
    """After an action: the audit log's line, and back to the page it came from with what
    happened (signed)."""
    log.info(
        "relay.console.action",
        action=request.path_params["name"],
        operator=_who(request).operator,
        done=message,
        **target,
    )
    base = request.scope.get("root_path", "")
    target_url = _local(base, form.get("next"))
    sep = "&" if "?" in target_url else "?"
    sig = console_of(request).guard.sign(message)
    return RedirectResponse(f"{target_url}{sep}msg={quote(message)}&sig={sig}", status_code=303)


# --- sign-in ---------------------------------------------------------------------------------


async def login(request: Request) -> Response:
    console = console_of(request)
    form = await _form(request)
    base = request.scope.get("root_path", "")
    who = console.guard.identify(form.get("token", ""))
    if who is None:
        client = request.client.host if request.client else None
        log.warning("relay.console.sign_in_refused", client=client)
        return console.render(
            request,
            "login.html",
            status_code=401,
            error="wrong token",
            next=form.get("next", ""),
            signed_in=False,
        )
    response = RedirectResponse(_local(base, form.get("next")), status_code=303)
    response.set_cookie(
        cookie_name(base),
        console.guard.new_session(who),
        max_age=SESSION_SECONDS,
        httponly=True,
        secure=True,  # browsers keep it on http://127.0.0.1 and localhost too
        samesite="strict",
        path=base + "/",
    )
    log.info("relay.console.signed_in", operator=who.operator)
    return response


async def logout(request: Request) -> Response:
    """Sign-out ends the session here, not only in the browser: its cookie, kept or copied,
    no longer signs anyone in."""
    console = console_of(request)
    base = request.scope.get("root_path", "")
    ended = console.guard.end_session(request.cookies.get(cookie_name(base), ""))
    if ended is not None:
        log.info("relay.console.signed_out", operator=ended.who.operator)
    response = RedirectResponse(base + "/login", status_code=303)
    response.delete_cookie(cookie_name(base), path=base + "/", secure=True, httponly=True)
    return response


# --- actions ---------------------------------------------------------------------------------


async def act(request: Request) -> Response:
    console = console_of(request)
    name = request.path_params["name"]
    if console.read_only:
        return _refused(request, "the console is read-only: actions are off", 403)
    kind = request.headers.get("content-type", "").split(";", 1)[0].strip().lower()
    if kind != "application/x-www-form-urlencoded":
        return _refused(request, "actions take an urlencoded form", 415)
    form = await _form(request)
    caller = caller_of(request)
    assert caller is not None  # the gate
    why = console.guard.action_allowed(request, caller, form.get(CSRF_FIELD))
    if why is not None:
        return _refused(request, why, 403)
    handler = ACTIONS.get(name)
    if handler is None:
        return _refused(request, f"no action {name!r}", 404)
    try:
        return await handler(request, form)
    except (AdminError, OutboxError, ValueError, OverflowError) as exc:
        return _refused(request, describe(exc) if not isinstance(exc, AdminError) else str(exc))


def _refused(request: Request, why: str, status: int = 400) -> Response:
    caller = caller_of(request)
    log.warning(
        "relay.console.refused",
        path=request.url.path,
        action=request.path_params.get("name"),
        operator=caller.who.operator if caller is not None else None,
        status=status,
        error=why,
    )
    return console_of(request).render(
        request, "message.html", status_code=status, title="Refused", text=why
    )


def _ids(form: Form) -> list[int]:
    raw = form.get("ids", "").replace(",", " ").split()
    if not raw or not all(_whole(x) is not None for x in raw):
        raise AdminError("give the row ids, separated by spaces or commas")
    return sorted({int(x) for x in raw})


MAX_ID = 2**63 - 1


def _whole(text: str | None) -> int | None:
    """A positive id as PostgreSQL's bigint holds it, or None."""
    if not text or not (text.isascii() and text.isdigit()):
        return None
    value = int(text)
    return value if 0 < value <= MAX_ID else None


def _confirmed(form: Form) -> bool:
    return form.get("confirm") == "yes"


def _own_fields(form: Form) -> Form:
    return {k: v for k, v in form.items() if k not in NOT_THE_ACTIONS}


def _ask(
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
        back=_local(request.scope.get("root_path", ""), form.get("next")),
    )


def _preview(
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
    fields["selection"] = _seal(request, _own_fields(fields), selection)
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
        back=_local(request.scope.get("root_path", ""), form.get("next")),
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


def _selection(request: Request, form: Form) -> Selection:
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
        _purpose(request, _own_fields(form)), text, signature
    ):
        raise wrong
    try:
        rows, max_id, digest, at = (int(p) for p in parts)
    except ValueError:
        raise wrong from None
    return Selection(rows, max_id, digest, EPOCH + timedelta(microseconds=at))


def _per_destination(result: dict[str, Any]) -> list[str]:
    lines = []
    for dest, counts in sorted(result.get("destinations", {}).items()):
        if isinstance(counts, dict):
            listed = ", ".join(f"{k} {v}" for k, v in counts.items())
        else:
            listed = str(counts)
        lines.append(f"{dest}: {listed}")
    return lines


async def _retry(request: Request, form: Form) -> Response:
    console = console_of(request)
    if form.get("ids"):
        flt = RetryFilter(ids=_ids(form))
    else:
        dest = form.get("destination") or None
        error_like = form.get("error_like") or None
        if dest is None and error_like is None and form.get("all") != "on":
            # As `outbox-relay retry`, which needs --all for every failed row everywhere.
            raise AdminError("say which failed rows: a destination, an error text, or all")
        flt = RetryFilter(destinations=[dest] if dest else None, error_like=error_like)

    async def preview(conn: asyncpg.Connection, changed: str | None = None) -> Response:
        counted, selection = await admin.retry_preview(conn, console.schema, flt)
        lines = _per_destination(counted)
        return _preview(request, form, "Retry failed rows", lines, selection, changed)

    async with console.connection() as conn:
        if not _confirmed(form):
            return await preview(conn)
        within = _selection(request, form)
        try:
            done = await admin.retry(conn, console.schema, flt, dry_run=False, within=within)
        except SelectionChanged as exc:
            return await preview(conn, str(exc))
    return _done(
        request,
        form,
        f"{done['rows']} row(s) back to pending",
        rows=done["rows"],
        destinations=sorted(done["destinations"]),
    )


async def _skip(request: Request, form: Form) -> Response:
    """Skip names its rows by id: the preview lists them, and its confirmation is refused
    (admin.skip) if one of them is no longer failed."""
    console = console_of(request)
    ids = _ids(form)
    by = _who(request).by
    async with console.connection() as conn:
        if not _confirmed(form):
            preview = await admin.skip(conn, console.schema, ids, by, dry_run=True)
            lines = [f"rows {', '.join(map(str, preview['ids']))}: failed → skipped (never sent)"]
            return _ask(request, form, "Skip failed rows", lines, preview["rows"])
        done = await admin.skip(conn, console.schema, ids, by, dry_run=False)
    return _done(request, form, f"{done['rows']} row(s) skipped", ids=done["ids"])


async def _purge(request: Request, form: Form) -> Response:
    console = console_of(request)
    if not form.get("older_than"):
        raise AdminError("say how old: older_than, e.g. 7d (as `outbox-relay purge --older-than`)")
    older_than = parse_duration(form["older_than"])
    dest = form.get("destination") or None
    args: dict[str, Any] = {
        "older_than": older_than,
        "failed": form.get("failed") == "on",
        "destinations": [dest] if dest else None,
    }

    async def preview(conn: asyncpg.Connection, changed: str | None = None) -> Response:
        counted, selection = await admin.purge_preview(conn, console.schema, **args)
        lines = _per_destination(counted)
        return _preview(request, form, "Purge finished rows", lines, selection, changed)

    async with console.connection() as conn:
        if not _confirmed(form):
            return await preview(conn)
        within = _selection(request, form)
        try:
            done = await admin.purge(
                conn, console.schema, dry_run=False, batch_size=PURGE_BATCH, within=within, **args
            )
        except SelectionChanged as exc:
            return await preview(conn, str(exc))
    return _done(
        request,
        form,
        f"{done['rows']} row(s) deleted",
        rows=done["rows"],
        destination=dest,
        older_than_s=older_than,
    )


async def _pause(request: Request, form: Form) -> Response:
    console = console_of(request)
    dest = form.get("destination", "")
    if not dest:
        raise AdminError("which destination?")
    reason = form.get("reason") or None
    if not _confirmed(form):
        lines = [
            "Relays stop claiming its rows until it is resumed; rows being sent now finish.",
            f"Reason: {reason}" if reason else "No reason given (shown by status).",
        ]
        return _ask(request, form, f"Pause destination {dest}", lines)
    async with console.connection() as conn:
        await admin.pause(conn, console.schema, dest, _who(request).by, reason)
    return _done(request, form, f"{dest} paused", destination=dest, reason=reason)


async def _resume(request: Request, form: Form) -> Response:
    console = console_of(request)
    dest = form.get("destination", "")
    async with console.connection() as conn:
        done = await admin.resume(conn, console.schema, dest)
    return _done(
        request,
        form,
        f"{dest} resumed" if done["was_paused"] else f"{dest} was not paused",
        destination=dest,
    )


async def _endpoint_row(request: Request, endpoint: int) -> Any:
    console = console_of(request)
    async with console.connection() as conn:
        found = await conn.fetchrow(render_ops(queries.ENDPOINT_ROW, console.schema), endpoint)
    if found is None:
        raise AdminError(
            f"no endpoint {endpoint} (the endpoints page lists them). Nothing changed."
        )
    return found


def _named(endpoint: Any) -> str:
    return (
        f"endpoint {endpoint['id']} of {endpoint['destination']} ({admin.origin(endpoint['url'])})"
    )


async def _replay(request: Request, form: Form) -> Response:
    console = console_of(request)
    endpoint = _whole(form.get("endpoint"))
    if form.get("event"):
        event = _whole(form["event"])
        if event is None:
            raise AdminError("the event id must be a whole number")
        if form.get("endpoint") and endpoint is None:
            raise AdminError("the endpoint id must be a whole number")
        if not _confirmed(form):
            to = _named(await _endpoint_row(request, endpoint)) if endpoint else "its endpoints"
            lines = [
                f"Event {event} is sent again to {to}, due now, with the same webhook-id "
                "(receivers that deduplicate on it see it once).",
            ]
            return _ask(request, form, f"Replay event {event}", lines)
        async with console.connection() as conn:
            done = await admin.replay_event(conn, console.schema, event, endpoint)
        return _done(
            request,
            form,
            f"event {event} replayed ({_count(done)})",
            event_id=event,
            endpoint=endpoint,
            replayed=done["replayed"],
        )
    if endpoint is None:
        raise AdminError("give an event id, or an endpoint and a window")
    since = parse_duration(form.get("since") or "1h")
    failed_only = form.get("failed_only") == "on"

    async def preview(conn: asyncpg.Connection, changed: str | None = None) -> Response:
        counted, selection = await admin.replay_endpoint_preview(
            conn, console.schema, endpoint, since, failed_only=failed_only
        )
        lines = [f"{k}: {v}" for k, v in counted.items() if isinstance(v, int | str)]
        return _preview(request, form, f"Replay to endpoint {endpoint}", lines, selection, changed)

    async with console.connection() as conn:
        if not _confirmed(form):
            return await preview(conn)
        within = _selection(request, form)
        try:
            done = await admin.replay_endpoint(
                conn, console.schema, endpoint, since, failed_only=failed_only, within=within
            )
        except SelectionChanged as exc:
            return await preview(conn, str(exc))
    return _done(
        request,
        form,
        f"replayed to endpoint {endpoint} ({_count(done)})",
        endpoint=endpoint,
        since_s=since,
        failed_only=failed_only,
        replayed=done["replayed"],
    )


def _count(result: dict[str, Any]) -> int:
    for key in ("replayed", "rows", "deliveries"):
        value = result.get(key)
        if isinstance(value, int):
            return value
        if isinstance(value, list):
            return len(value)
    return 0


async def _endpoint_state(request: Request, form: Form) -> Response:
    """Disable, enable or rotate an endpoint's secret, through outbox.endpoints. A new secret
    is never shown here: the command line shows it to whoever may see it."""
    import outbox.endpoints as api

    console = console_of(request)
    what = request.path_params["name"]
    eid = _whole(form.get("endpoint"))
    if eid is None:
        raise AdminError("which endpoint?")
    if what != "endpoint-enable" and not _confirmed(form):
        found = await _endpoint_row(request, eid)
        if what == "endpoint-disable":
            lines = [
                f"Nothing more is sent to {_named(found)} until it is enabled again: its "
                "pending deliveries wait, and its destination's new events pass it by.",
            ]
            return _ask(request, form, f"Disable endpoint {eid}", lines)
        lines = [
            f"{_named(found)} gets a new secret; the previous one keeps signing for 24 h, so "
            "give the receiver the new one before then "
            f"(`outbox-relay endpoints show {eid} --show-secret`).",
        ]
        return _ask(request, form, f"Rotate the secret of endpoint {eid}", lines)
    endpoints = api.Endpoints(schema=console.schema)
    async with console.sqlalchemy().begin() as conn:
        if what == "endpoint-disable":
            await endpoints.disable(conn, eid, reason=form.get("reason") or "disabled in console")
            return _done(request, form, f"endpoint {eid} disabled", endpoint=eid)
        if what == "endpoint-enable":
            await endpoints.enable(conn, eid)
            return _done(request, form, f"endpoint {eid} enabled", endpoint=eid)
        await endpoints.rotate_secret(conn, eid)
    return _done(
        request,
        form,
        f"endpoint {eid} has a new secret (the previous one signs for 24 h); read it with "
        f"`outbox-relay endpoints show {eid} --show-secret`",
        endpoint=eid,
    )


async def _endpoint_add(request: Request, form: Form) -> Response:
    """Register an endpoint through outbox.endpoints (its checks: URL, DNS, addresses)."""
    import outbox.endpoints as api

    console = console_of(request)
    rate = form.get("rate_limit", "").strip()
    if rate and _whole(rate) is None:
        raise AdminError("the rate limit is a whole number of requests per second")
    async with console.sqlalchemy().begin() as conn:
        ep = await api.Endpoints(schema=console.schema).create(
            conn,
            destination=form.get("destination", "").strip(),
            url=form.get("url", "").strip(),
            tenant=form.get("tenant", "").strip() or None,
            event_types=[t.strip() for t in form.get("event_types", "").split(",") if t.strip()],
            rate_limit=int(rate) if rate else None,
            allow_private_networks=form.get("allow_private_networks") == "on",
        )
    return _done(
        request,
        form,
        f"added endpoint {ep.id} to {ep.destination}; read its secret with "
        f"`outbox-relay endpoints show {ep.id} --show-secret`",
        endpoint=ep.id,
        destination=ep.destination,
    )


ACTIONS: dict[str, Callable[[Request, Form], Awaitable[Response]]] = {
    "retry": _retry,
    "skip": _skip,
    "purge": _purge,
    "pause": _pause,
    "resume": _resume,
    "replay": _replay,
    "endpoint-add": _endpoint_add,
    "endpoint-disable": _endpoint_state,
    "endpoint-enable": _endpoint_state,
    "endpoint-rotate": _endpoint_state,
}
