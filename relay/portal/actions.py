"""The portal page's forms: each posts to ``/actions/{name}`` with the session's CSRF value,
and calls the same changes and replays as the API (relay/portal/changes.py, replays.py). A
new secret is shown on the answer to the form that made it, never in a URL."""

from __future__ import annotations

from datetime import timedelta
from urllib.parse import parse_qs

import structlog
from starlette.requests import Request
from starlette.responses import RedirectResponse, Response

from outbox.endpoints import portal_tokens as pt
from relay.ops.common import AdminError
from relay.ops.selection import SelectionChanged
from relay.portal import changes, reads, replays, sessions
from relay.portal.pages import render
from relay.portal.scope import Scope
from relay.portal.state import Portal

log = structlog.get_logger("relay.portal")
MAX_FIELD = 4096


# Fields a form may repeat (the add form's event type checkboxes): their values joined by a
# line break, which no event type holds (outbox.message refuses control characters).
REPEATED = frozenset({"event_type"})


async def read_form(request: Request) -> dict[str, str]:
    """An urlencoded form (the pages send no other), one value per field but those in
    REPEATED; NUL characters (which PostgreSQL text cannot hold) removed. The gate caps the
    body's size."""
    body = await request.body()
    fields = parse_qs(body.decode("utf-8", "replace"), keep_blank_values=True)
    return {
        k: ("\n".join(v) if k in REPEATED else v[-1]).replace("\x00", "") for k, v in fields.items()
    }


def _field(form: dict[str, str], name: str) -> str:
    return form.get(name, "").strip()[:MAX_FIELD]


def _id(form: dict[str, str], name: str) -> int:
    text = _field(form, name)
    if not (text.isascii() and text.isdigit()) or not 1 <= int(text) <= 2**63 - 1:
        raise reads.NotFound(text)
    return int(text)


async def act(request: Request) -> Response:
    portal: Portal = request.app.state.portal
    scope: Scope = request.scope["state"]["portal_scope"]
    name = request.path_params["name"]
    form = await read_form(request)
    why = sessions.refused(request, portal.keys, scope, form.get(sessions.CSRF_FIELD))
    if why is not None:
        return render(request, "notice.html", 403, title="Refused", text=why)
    base = request.scope.get("root_path", "")
    try:
        async with portal.connection() as conn:
            if name in ("replay-count", "replay-window"):
                return await _window(request, name, form, conn, portal, scope)
            answer = await _run(name, form, conn, portal, scope, base)
    except reads.NotFound:
        return render(request, "notice.html", 404, title="Not found", text="no such object")
    except PermissionError as exc:
        return render(request, "notice.html", 403, title="Refused", text=str(exc))
    except (changes.Conflict, SelectionChanged) as exc:
        return render(request, "notice.html", 409, title="Changed", text=str(exc))
    except (changes.Refused, AdminError, ValueError) as exc:
        return render(request, "notice.html", 400, title="Refused", text=str(exc))
    log.info("relay.portal.action", tenant=scope.tenant, token_id=scope.token_id, action=name)
    if isinstance(answer, str):
        return RedirectResponse(base + answer, 303)
    return render(request, "secret.html", endpoint=answer)


async def _run(
    name: str, form: dict[str, str], conn: object, portal: Portal, scope: Scope, base: str
) -> object:
    """The action: a path to go to next, or an endpoint whose new secret is shown."""
    import asyncpg

    assert isinstance(conn, asyncpg.Connection)
    if name == "add":
        typed = _field(form, "event_types").split(",")  # the field without a catalog
        chosen = form.get("event_type", "").split("\n")  # the catalog's checkboxes
        types = [t.strip() for t in (*typed, *chosen) if t.strip()]
        return await changes.create(
            conn, scope, portal.policy, url=_field(form, "url"), event_types=types,
            description=_field(form, "description"),
        )  # fmt: skip
    if name == "rotate":
        return await changes.rotate_secret(conn, scope, _id(form, "endpoint"), timedelta(hours=24))
    if name in ("disable", "enable", "delete", "test"):
        endpoint_id = _id(form, "endpoint")
        if name == "disable":
            await changes.disable(conn, scope, endpoint_id, _field(form, "reason") or None)
        elif name == "enable":
            await changes.enable(conn, scope, endpoint_id)
        elif name == "delete":
            await changes.delete(conn, scope, endpoint_id)
            return "/endpoints"
        else:
            sent = await changes.send_test(conn, scope, endpoint_id)
            return f"/messages/{sent.delivery_id}"
        return f"/endpoints/{endpoint_id}"
    if name == "replay":
        delivery_id = _id(form, "message")
        await replays.replay_message(conn, scope, delivery_id)
        return f"/messages/{delivery_id}"
    raise reads.NotFound(name)


WINDOWS = {"1h": 3600.0, "24h": 86400.0, "7d": 7 * 86400.0, "30d": 30 * 86400.0}


async def _window(
    request: Request, name: str, form: dict[str, str], conn: object, portal: Portal, scope: Scope
) -> Response:
    """A window's replay from the page: counted first (replay-count: the preview, with the
    count's sealed selection in the form), then sent exactly as counted (replay-window)."""
    import asyncpg

    assert isinstance(conn, asyncpg.Connection)
    seconds = WINDOWS.get(_field(form, "since"))
    if seconds is None:
        raise ValueError("choose a window: " + ", ".join(WINDOWS))
    endpoint = _id(form, "endpoint") if _field(form, "endpoint") else None
    window = replays.Window(seconds, endpoint, _field(form, "failed_only") == "on")
    if name == "replay-count":
        counted = await replays.count(conn, scope, window)
        sealed = replays.seal(portal.keys, scope, window, counted.selections)
        return render(request, "replay_confirm.html", counted=counted, form=form, selection=sealed)
    selections = replays.unseal(portal.keys, scope, window, _field(form, "selection"))
    if selections is None:
        raise ValueError("the count is not of this window: count again")
    done = await replays.replay(conn, scope, window, selections)
    sent = sum(r.replayed for r in done)
    text = f"{sent} message(s) will be sent again, with the webhook-id each had."
    return render(request, "notice.html", title="Sent again", text=text)


async def sign_in(request: Request) -> Response:
    """The link's token, posted once by portal.js (or pasted): a session cookie. Only from
    the portal's own pages (a page elsewhere must not sign a browser in as another tenant)."""
    portal: Portal = request.app.state.portal
    site = request.headers.get("sec-fetch-site")
    origin = request.headers.get("origin")
    own = f"{request.url.scheme}://{request.headers.get('host', '')}"
    if (site is not None and site != "same-origin") or (
        site is None and origin is not None and origin != own
    ):
        return render(request, "notice.html", 403, title="Refused", text="request refused")
    form = await read_form(request)
    token = form.get("token")
    base = request.scope.get("root_path", "")
    response = RedirectResponse(base + "/endpoints", 303)
    try:
        if not isinstance(token, str):
            raise sessions.PortalTokenRefused("malformed", "no token")
        token = token.strip()
        current = sessions.scope_of(request, portal.keys, portal.schema)
        if current is not None and form.get("replace") != "yes":
            # Signed in already: a link opened from elsewhere (a page of another site can
            # send the browser to one of its own tenant's links) must not swap the tenant
            # under the person's feet without their say (found by review).
            asked = pt.verify_portal_token(token, key=portal.keys, schema=portal.schema)
            if asked.tenant != current.tenant or asked.write != current.write:
                return render(request, "switch.html", asked=asked, current=current, token=token)
        access = sessions.start(
            response, request, portal.keys, portal.schema, token,
            framed=bool(portal.embed_origins),
        )  # fmt: skip
    except sessions.PortalTokenRefused as exc:
        log.info("relay.portal.token_refused", reason=exc.reason)
        return render(
            request, "landing.html", 401,
            refused="This link is not valid, or has expired: ask for a new one.",
        )  # fmt: skip
    log.info("relay.portal.signed_in", tenant=access.tenant, token_id=access.token_id)
    return response


async def sign_out(request: Request) -> Response:
    base = request.scope.get("root_path", "")
    response = RedirectResponse(base + "/", 303)
    sessions.end(response, request)
    return response
