"""Portal tokens (outbox/endpoints/portal_tokens.py): minted by an application, verified by the
portal. No database: a pure module (in [tool.mutmut])."""

from __future__ import annotations

import base64
import json
from datetime import UTC, datetime, timedelta
from typing import Any

import jwt
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import outbox.endpoints
from outbox.endpoints import portal_tokens as pt
from outbox.errors import OutboxValidationError

KEY = pt.new_portal_key()
OLD = pt.new_portal_key()
NOW = datetime(2026, 12, 7, 12, 0, tzinfo=UTC)


def raw(key: str) -> bytes:
    return pt._unb64(key[len(pt.KEY_PREFIX) :])


def mint(**kw: Any) -> str:
    kw.setdefault("key", KEY)
    kw.setdefault("now", NOW)
    return pt.portal_token(tenant=kw.pop("tenant", "acme"), **kw)


def verify(token: str, **kw: Any) -> pt.PortalAccess:
    kw.setdefault("key", KEY)
    kw.setdefault("now", NOW)
    return pt.verify_portal_token(token, **kw)


def refused(token: str, **kw: Any) -> str:
    with pytest.raises(pt.PortalTokenRefused) as e:
        verify(token, **kw)
    return e.value.reason


def forge(claims: dict[str, Any], header: dict[str, Any] | None = None, key: str = KEY) -> str:
    """A token with these claims and header, signed with ``key`` as ours are (PyJWT)."""
    h = header if header is not None else {"kid": pt.key_id(raw(key))}
    return jwt.encode(claims, raw(key), algorithm="HS256", headers=h)


def claims(**over: Any) -> dict[str, Any]:
    iat = int(NOW.timestamp())
    c = {
        "iss": "outbox-relay",
        "aud": "outbox-portal:public",
        "sub": "acme",
        "scope": "read write",
        "iat": iat,
        "exp": iat + 3600,
        "jti": "A" * 22,
    }
    c.update(over)
    return {k: v for k, v in c.items() if v is not None}


def test_a_token_opens_its_tenant_read_write_until_it_expires() -> None:
    access = verify(mint(ttl=timedelta(minutes=5)))
    assert access.tenant == "acme" and access.write
    assert access.expires == NOW + timedelta(minutes=5)
    assert len(access.token_id) == 22
    assert not verify(mint(read_only=True)).write
    assert verify(mint()).token_id != verify(mint()).token_id  # each token its own id


def test_the_functions_are_names_of_outbox_endpoints() -> None:
    assert outbox.endpoints.portal_token is pt.portal_token
    assert outbox.endpoints.verify_portal_token is pt.verify_portal_token
    assert outbox.endpoints.portal_url is pt.portal_url


@pytest.mark.parametrize(
    ("shift", "reason"),
    [(59, None), (61, "expired")],
)
def test_expiry_has_a_minute_of_leeway(shift: int, reason: str | None) -> None:
    token = mint(ttl=600)
    later = NOW + timedelta(seconds=600 + shift)
    if reason is None:
        assert verify(token, now=later).tenant == "acme"
    else:
        assert refused(token, now=later) == reason


@pytest.mark.parametrize(("shift", "ok"), [(-59, True), (-61, False)])
def test_a_token_from_the_future_has_a_minute_of_leeway(shift: int, ok: bool) -> None:
    token = mint(now=NOW - timedelta(seconds=shift))  # minted by a clock |shift| s ahead
    if ok:
        verify(token)
    else:
        assert refused(token) == "not_yet"


@pytest.mark.parametrize(("nbf", "ok"), [(59, True), (61, False)])
def test_not_before_has_a_minute_of_leeway(nbf: int, ok: bool) -> None:
    token = forge(claims(nbf=int(NOW.timestamp()) + nbf))
    if ok:
        verify(token)
    else:
        assert refused(token) == "not_yet"


def test_a_lifetime_over_seven_days_is_refused_when_minted_and_when_verified() -> None:
    mint(ttl=timedelta(days=7))
    for ttl in (timedelta(days=7, seconds=1), 0, -5, True, "1h"):
        with pytest.raises(OutboxValidationError):
            mint(ttl=ttl)
    iat = int(NOW.timestamp())
    assert refused(forge(claims(exp=iat + 7 * 86400 + 1))) == "claims"
    assert refused(forge(claims(exp=iat))) == "claims"  # exp must follow iat


@pytest.mark.parametrize(
    ("header", "reason"),
    [
        ({"alg": "none", "typ": "JWT"}, "algorithm"),
        ({"typ": "JWT", "x": 1}, "algorithm"),  # a member of its own
        ({"typ": "JWT", "crit": ["exp"]}, "algorithm"),
        ({"typ": "JOSE"}, "algorithm"),
        ({}, "algorithm"),  # no typ: PyJWT's defaults are alg and typ
    ],
)
def test_only_the_one_header_is_taken(header: dict[str, Any], reason: str) -> None:
    h = {"kid": pt.key_id(raw(KEY)), **header}
    if h.get("alg") == "none":
        body = base64.urlsafe_b64encode(json.dumps(claims()).encode()).rstrip(b"=").decode()
        head = base64.urlsafe_b64encode(json.dumps(h).encode()).rstrip(b"=").decode()
        token = f"{head}.{body}."
    else:
        token = jwt.encode(claims(), raw(KEY), algorithm="HS256", headers=h)
        if "typ" not in header:
            # PyJWT adds typ JWT itself; take it out again for the case without one.
            head, rest = token.split(".", 1)
            decoded = json.loads(pt._unb64(head))
            decoded.pop("typ")
            token = pt._b64(json.dumps(decoded).encode()) + "." + rest
    assert refused(token) == reason


def test_other_algorithms_are_refused_before_any_key_is_looked_at() -> None:
    for alg in ("HS512", "HS384"):
        # A key long enough for PyJWT's own warning; the alg is refused before any key.
        token = jwt.encode(claims(), raw(KEY) * 2, algorithm=alg, headers={"kid": "whatever"})
        assert refused(token) == "algorithm"


def test_an_unknown_key_id_and_a_wrong_signature_are_refused() -> None:
    assert refused(mint(key=OLD)) == "unknown_key"
    kid = pt.key_id(raw(KEY))
    other = jwt.encode(claims(), raw(OLD), algorithm="HS256", headers={"kid": kid})
    assert refused(other) == "signature"


@pytest.mark.parametrize(
    ("over", "reason"),
    [
        ({"aud": "outbox-portal:other"}, "audience"),
        ({"aud": ["outbox-portal:public"]}, "audience"),
        ({"iss": "someone"}, "claims"),
        ({"scope": "write"}, "claims"),
        ({"scope": "read admin"}, "claims"),
        ({"scope": "read read"}, "claims"),
        ({"scope": ["read"]}, "claims"),
        ({"sub": ""}, "claims"),
        ({"sub": "a\nb"}, "claims"),
        ({"sub": 7}, "claims"),
        ({"jti": "short"}, "claims"),
        ({"jti": None}, "claims"),
        ({"exp": 1.5e9}, "claims"),
        ({"iat": True}, "claims"),
        ({"tenant": "other"}, "claims"),  # a claim not known here
    ],
)
def test_claims_are_checked(over: dict[str, Any], reason: str) -> None:
    assert refused(forge(claims(**over))) == reason


def test_a_token_for_one_schema_opens_no_other() -> None:
    token = mint(schema="billing")
    assert verify(token, schema="billing").tenant == "acme"
    assert refused(token) == "audience"


def test_rotation_the_first_key_signs_and_every_one_verifies() -> None:
    old_token = mint(key=OLD)
    both = f"{KEY}, {OLD}"
    assert verify(old_token, key=both).tenant == "acme"
    new_token = mint(key=both)
    assert verify(new_token, key=KEY).tenant == "acme"  # signed by the first
    assert refused(new_token, key=OLD) == "unknown_key"
    assert refused(old_token, key=KEY) == "unknown_key"  # the old one dropped


def test_pyjwt_verifies_our_tokens_and_we_verify_its() -> None:
    token = pt.portal_token(tenant="acme", key=KEY)  # now: PyJWT checks iat on its clock
    decoded = jwt.decode(
        token, raw(KEY), algorithms=["HS256"], audience="outbox-portal:public", options={}
    )
    assert decoded["sub"] == "acme" and decoded["scope"] == "read write"
    ours = jwt.encode(
        claims(sub="globex", scope="read"), raw(KEY), "HS256", {"kid": pt.key_id(raw(KEY))}
    )
    access = verify(ours)
    assert access.tenant == "globex" and not access.write


def test_the_key_comes_from_the_environment_and_its_absence_is_named(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv(pt.KEY_VARIABLE, raising=False)
    with pytest.raises(pt.PortalKeyMissing, match="OUTBOX_PORTAL_KEY"):
        pt.portal_token(tenant="acme")
    monkeypatch.setenv(pt.KEY_VARIABLE, f"{KEY},{OLD}")
    assert pt.verify_portal_token(pt.portal_token(tenant="acme"), key=KEY).tenant == "acme"


@pytest.mark.parametrize(
    "text",
    ["abc", "opk_", "opk_" + "A" * 42, "opk_" + pt._b64(b"x" * 31), f"{KEY},", "opk_!!!!"],
    # Named: a random key in an id differs between xdist's workers.
    ids=["no-prefix", "empty", "not-canonical", "31-bytes", "trailing-comma", "not-base64"],
)
def test_a_bad_key_is_refused_naming_which(text: str) -> None:
    with pytest.raises(OutboxValidationError) as e:
        pt.PortalKeys.parse(text)
    assert KEY[4:] not in str(e.value)


def test_neither_a_key_nor_a_token_shows_in_a_repr_or_an_error() -> None:
    keys = pt.PortalKeys.parse(f"{KEY},{OLD}")
    assert KEY[4:] not in repr(keys) and "2 key" in repr(keys)
    token = mint()
    with pytest.raises(pt.PortalTokenRefused) as e:
        verify(token, key=OLD)
    assert token not in str(e.value) and KEY[4:] not in str(e.value)


def test_the_url_carries_the_token_in_its_fragment() -> None:
    url = pt.portal_url("https://hooks.example.com/portal/", tenant="acme", key=KEY)
    base, token = url.split("#token=")
    assert base == "https://hooks.example.com/portal/"
    assert pt.verify_portal_token(token, key=KEY).tenant == "acme"
    for bad in ("hooks.example.com/portal", "ftp://x/", "https://x/#y", "javascript:alert(1)"):
        with pytest.raises(OutboxValidationError):
            pt.portal_url(bad, tenant="acme", key=KEY)


@pytest.mark.parametrize(
    "token",
    ["", "a.b", "a.b.c.d", "x" * 5000, "!!.!!.!!", "e30.e30.", 7],
)
def test_malformed_tokens_are_refused(token: Any) -> None:
    assert refused(token) in ("malformed", "algorithm")


def test_deeply_nested_json_is_refused_not_a_crash() -> None:
    head = pt._b64(b"[" * 2500 + b"]" * 2500)
    assert refused(f"{head}.e30.AAAA") == "malformed"


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_any_changed_character_is_refused(data: st.DataObject) -> None:
    token = mint()
    at = data.draw(st.integers(0, len(token) - 1))
    alphabet = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_."
    char = data.draw(st.sampled_from([c for c in alphabet if c != token[at]]))
    changed = token[:at] + char + token[at + 1 :]
    with pytest.raises(pt.PortalTokenRefused):
        verify(changed)


def test_a_seal_holds_for_its_purpose_and_data_under_any_key() -> None:
    keys = pt.PortalKeys.parse(KEY)
    sig = keys.seal("selection", b"data")
    assert keys.sealed("selection", b"data", sig)
    assert not keys.sealed("selection", b"datb", sig)
    assert not keys.sealed("other", b"data", sig)
    assert not keys.sealed("selection", b"data", sig[:-1] + ("A" if sig[-1] != "A" else "B"))
    assert not keys.sealed("selection", b"data", "é")
    assert pt.PortalKeys.parse(f"{OLD},{KEY}").sealed("selection", b"data", sig)  # rotated
    assert not pt.PortalKeys.parse(OLD).sealed("selection", b"data", sig)
