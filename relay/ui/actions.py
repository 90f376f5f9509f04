"""The console's actions: sign-in, and what operators do to rows, destinations and endpoints.

Each action is the operation the command runs (relay/ops, outbox.endpoints),
with its checks and refusals. None acts on the first click: those that change or delete many
rows (retry, skip, purge, a replay of an endpoint's window) first show a preview with the
counts of a dry run, and its confirmation acts on exactly the rows it counted or refuses
(the form carries their selection, signed); pausing, disabling an endpoint, rotating its
secret and replaying one event first say what they will do. The confirmation is a field the
server checks, so a form posted without it only ever gets the question. Every action is
refused in read-only mode, and without the session's CSRF value and a same-origin request
(see security.py); each one done is logged as ``relay.console.action``, with the operator
(relay/ui/forms.py).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from typing import Any, TypeVar

import asyncpg
import structlog
from starlette.requests import Request
from starlette.responses import RedirectResponse, Response

from outbox.errors import OutboxError, describe
from outbox.queries import qualified_table
from relay.db.queries import render_ops
from relay.durations import parse_duration
from relay.ops import endpoints as endpoint_ops
from relay.ops import pause as pausing
from relay.ops import purge as purging
from relay.ops import replay as replaying
from relay.ops import retry as retrying
from relay.ops.common import AdminError, origin
from relay.ops.purge import Purged, PurgeScope
from relay.ops.replay import ReplayedEndpoint
from relay.ops.retry import Retried, RetryFilter
from relay.ops.selection import Selection, SelectionChanged
from relay.ui import queries
from relay.ui.forms import (
    Form,
    ask,
    confirmed,
    finish,
    ids_of,
    local_target,
    preview_form,
    read_form,
    selection_of,
    who_of,
    whole,
)
from relay.ui.pages import caller_of, console_of
from relay.ui.security import CSRF_FIELD, SESSION_SECONDS, cookie_name

T = TypeVar("T")

log = structlog.get_logger("relay.console")

PURGE_BATCH = 5000

# --- sign-in ---------------------------------------------------------------------------------


async def login(request: Request) -> Response:
    console = console_of(request)
    form = await read_form(request)
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
    response = RedirectResponse(local_target(base, form.get("next")), status_code=303)
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
    form = await read_form(request)
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
        return _refused(request, _wording(exc))


def _wording(exc: Exception) -> str:
    """A refusal as the console words it: the library's (an OutboxError, also when an operation
    passed it on as its own refusal) with its type, the console's and the operations' as said."""
    if isinstance(exc, AdminError):
        cause = exc.__cause__
        return describe(cause) if isinstance(cause, OutboxError) else str(exc)
    return describe(exc)


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


def _per_destination(destinations: Mapping[str, Any]) -> list[str]:
    """A preview's counts, a line per destination."""
    lines = []
    for dest, counts in sorted(destinations.items()):
        if isinstance(counts, dict):
            listed = ", ".join(f"{k} {v}" for k, v in counts.items())
        else:
            listed = str(counts)
        lines.append(f"{dest}: {listed}")
    return lines


Counted = Callable[[asyncpg.Connection], Awaitable[tuple[list[str], Selection]]]


async def _previewed(
    request: Request,
    form: Form,
    title: str,
    counted: Counted,
    change: Callable[[asyncpg.Connection, Selection], Awaitable[T]],
    then: Callable[[T], Response],
) -> Response:
    """A change that many rows make: its preview (``counted``: its lines and the selection
    of rows counted) until it is confirmed; then ``change`` on exactly that selection, and
    ``then`` with its result; or, if the rows changed meanwhile, the preview again as things
    are now (409)."""
    console = console_of(request)
    async with console.connection() as conn:
        changed = None
        if confirmed(form):
            within = selection_of(request, form)
            try:
                done = await change(conn, within)
            except SelectionChanged as exc:
                changed = str(exc)
            else:
                return then(done)
        lines, selection = await counted(conn)
        return preview_form(request, form, title, lines, selection, changed)


async def _retry(request: Request, form: Form) -> Response:
    schema = console_of(request).schema
    if form.get("ids"):
        flt = RetryFilter(ids=ids_of(form))
    else:
        dest = form.get("destination") or None
        error_like = form.get("error_like") or None
        if dest is None and error_like is None and form.get("all") != "on":
            # As `outbox-relay retry`, which needs --all for every failed row everywhere.
            raise AdminError("say which failed rows: a destination, an error text, or all")
        flt = RetryFilter(destinations=[dest] if dest else None, error_like=error_like)

    async def counted(conn: asyncpg.Connection) -> tuple[list[str], Selection]:
        count, selection = await retrying.retry_preview(conn, schema, flt)
        return _per_destination(count.to_json()["destinations"]), selection

    def then(done: Retried) -> Response:
        return finish(
            request,
            form,
            f"{done.rows} row(s) back to pending",
            rows=done.rows,
            destinations=sorted(done.destinations),
        )

    return await _previewed(
        request,
        form,
        "Retry failed rows",
        counted,
        lambda conn, within: retrying.retry(conn, schema, flt, dry_run=False, within=within),
        then,
    )


async def _skip(request: Request, form: Form) -> Response:
    """Skip names its rows by id: the preview lists them, and its confirmation is refused
    (relay.ops.pause.skip) if one of them is no longer failed."""
    console = console_of(request)
    ids = ids_of(form)
    async with console.connection() as conn:
        if not confirmed(form):
            preview = await pausing.skip_count(conn, console.schema, ids)
            lines = [f"rows {', '.join(map(str, preview.ids))}: failed → skipped (never sent)"]
            return ask(request, form, "Skip failed rows", lines, preview.rows)
        done = await pausing.skip(conn, console.schema, ids, who_of(request).by)
    return finish(request, form, f"{done.rows} row(s) skipped", ids=done.ids)


async def _purge(request: Request, form: Form) -> Response:
    schema = console_of(request).schema
    if not form.get("older_than"):
        raise AdminError("say how old: older_than, e.g. 7d (as `outbox-relay purge --older-than`)")
    older_than = parse_duration(form["older_than"])
    dest = form.get("destination") or None
    scope = PurgeScope(older_than, form.get("failed") == "on", [dest] if dest else None)

    async def counted(conn: asyncpg.Connection) -> tuple[list[str], Selection]:
        count, selection = await purging.purge_preview(conn, schema, scope)
        return _per_destination(count.destinations), selection

    def then(done: Purged) -> Response:
        return finish(
            request,
            form,
            f"{done.rows} row(s) deleted",
            rows=done.rows,
            destination=dest,
            older_than_s=older_than,
        )

    return await _previewed(
        request,
        form,
        "Purge finished rows",
        counted,
        lambda conn, within: purging.purge(
            conn, schema, scope, batch_size=PURGE_BATCH, within=within
        ),
        then,
    )


async def _pause(request: Request, form: Form) -> Response:
    console = console_of(request)
    dest = form.get("destination", "")
    if not dest:
        raise AdminError("which destination?")
    reason = form.get("reason") or None
    if not confirmed(form):
        lines = [
            "Relays stop claiming its rows until it is resumed; rows being sent now finish.",
            f"Reason: {reason}" if reason else "No reason given (shown by status).",
        ]
        return ask(request, form, f"Pause destination {dest}", lines)
    async with console.connection() as conn:
        await pausing.pause(conn, console.schema, dest, who_of(request).by, reason)
    return finish(request, form, f"{dest} paused", destination=dest, reason=reason)


async def _resume(request: Request, form: Form) -> Response:
    console = console_of(request)
    dest = form.get("destination", "")
    async with console.connection() as conn:
        done = await pausing.resume(conn, console.schema, dest)
    return finish(
        request,
        form,
        f"{dest} resumed" if done.was_paused else f"{dest} was not paused",
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
    return f"endpoint {endpoint['id']} of {endpoint['destination']} ({origin(endpoint['url'])})"


async def _replay(request: Request, form: Form) -> Response:
    endpoint = whole(form.get("endpoint"))
    if form.get("event"):
        return await _replay_event(request, form, endpoint)
    if endpoint is None:
        raise AdminError("give an event id, or an endpoint and a window")
    schema = console_of(request).schema
    since = parse_duration(form.get("since") or "1h")
    failed_only = form.get("failed_only") == "on"

    async def counted(conn: asyncpg.Connection) -> tuple[list[str], Selection]:
        count, selection = await replaying.replay_endpoint_preview(
            conn, schema, endpoint, since, failed_only=failed_only
        )
        lines = [f"{k}: {v}" for k, v in count.to_json().items() if isinstance(v, int | str)]
        return lines, selection

    def then(done: ReplayedEndpoint) -> Response:
        return finish(
            request,
            form,
            f"replayed to endpoint {endpoint} ({done.replayed})",
            endpoint=endpoint,
            since_s=since,
            failed_only=failed_only,
            replayed=done.replayed,
        )

    return await _previewed(
        request,
        form,
        f"Replay to endpoint {endpoint}",
        counted,
        lambda conn, within: replaying.replay_endpoint(
            conn, schema, endpoint, since, failed_only=failed_only, within=within
        ),
        then,
    )


async def _replay_event(request: Request, form: Form, endpoint: int | None) -> Response:
    console = console_of(request)
    event = whole(form["event"])
    if event is None:
        raise AdminError("the event id must be a whole number")
    if form.get("endpoint") and endpoint is None:
        raise AdminError("the endpoint id must be a whole number")
    if not confirmed(form):
        to = _named(await _endpoint_row(request, endpoint)) if endpoint else "its endpoints"
        lines = [
            f"Event {event} is sent again to {to}, due now, with the same webhook-id "
            "(receivers that deduplicate on it see it once).",
        ]
        return ask(request, form, f"Replay event {event}", lines)
    async with console.connection() as conn:
        done = await replaying.replay_event(conn, console.schema, event, endpoint)
    return finish(
        request,
        form,
        f"event {event} replayed ({done.replayed})",
        event_id=event,
        endpoint=endpoint,
        replayed=done.replayed,
    )


async def _endpoint_state(request: Request, form: Form) -> Response:
    """Disable, enable or rotate an endpoint's secret: the operations the command line runs
    (relay.ops.endpoints). A new secret is never shown here: the command line shows it to
    whoever may see it."""
    console = console_of(request)
    what = request.path_params["name"]
    eid = whole(form.get("endpoint"))
    if eid is None:
        raise AdminError("which endpoint?")
    if what != "endpoint-enable" and not confirmed(form):
        found = await _endpoint_row(request, eid)
        if what == "endpoint-disable":
            lines = [
                f"Nothing more is sent to {_named(found)} until it is enabled again: its "
                "pending deliveries wait, and its destination's new events pass it by.",
            ]
            return ask(request, form, f"Disable endpoint {eid}", lines)
        lines = [
            f"{_named(found)} gets a new secret; the previous one keeps signing for 24 h, so "
            "give the receiver the new one before then "
            f"(`outbox-relay endpoints show {eid} --show-secret`).",
        ]
        return ask(request, form, f"Rotate the secret of endpoint {eid}", lines)
    async with console.connection() as conn:
        if what == "endpoint-disable":
            reason = form.get("reason") or "disabled in console"
            await endpoint_ops.disable(conn, console.schema, eid, reason=reason)
            return finish(request, form, f"endpoint {eid} disabled", endpoint=eid)
        if what == "endpoint-enable":
            await endpoint_ops.enable(conn, console.schema, eid)
            return finish(request, form, f"endpoint {eid} enabled", endpoint=eid)
        # Imported here, as relay.ops.endpoints imports the library's endpoints: a console that
        # never rotates a secret does not load them (nor SQLAlchemy).
        from outbox.endpoints.checks import DEFAULT_KEEP_PREVIOUS

        rotated = await endpoint_ops.rotate_secret(
            conn, console.schema, eid, keep_previous=DEFAULT_KEEP_PREVIOUS, secret=None
        )
    _warn_if_unencrypted(rotated, console.schema)
    return finish(
        request,
        form,
        f"endpoint {eid} has a new secret (the previous one signs for 24 h); read it with "
        f"`outbox-relay endpoints show {eid} --show-secret`",
        endpoint=eid,
    )


async def _endpoint_add(request: Request, form: Form) -> Response:
    """Register an endpoint: the operation `outbox-relay endpoints add` runs (the library's
    checks: URL, DNS, addresses)."""
    console = console_of(request)
    rate = form.get("rate_limit", "").strip()
    if rate and whole(rate) is None:
        raise AdminError("the rate limit is a whole number of requests per second")
    new = endpoint_ops.Registration(
        destination=form.get("destination", "").strip(),
        url=form.get("url", "").strip(),
        tenant=form.get("tenant", "").strip() or None,
        event_types=tuple(t.strip() for t in form.get("event_types", "").split(",") if t.strip()),
        rate_limit=int(rate) if rate else None,
        allow_private_networks=form.get("allow_private_networks") == "on",
    )
    async with console.connection() as conn:
        added = await endpoint_ops.add(conn, console.schema, new)
    _warn_if_unencrypted(added, console.schema)
    ep = added.endpoint
    return finish(
        request,
        form,
        f"added endpoint {ep.id} to {ep.destination}; read its secret with "
        f"`outbox-relay endpoints show {ep.id} --show-secret`",
        endpoint=ep.id,
        destination=ep.destination,
    )


def _warn_if_unencrypted(changed: endpoint_ops.Changed, schema: str) -> None:
    """The library's warning event for a secret stored in clear (the operations leave it to
    their caller: the command line says it on stderr, the console logs it as the library does)."""
    if changed.unencrypted:
        from outbox.endpoint_secrets import warn_unencrypted

        ep = changed.endpoint
        warn_unencrypted(ep.id, ep.destination, qualified_table(schema, "outbox_endpoints"))


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
