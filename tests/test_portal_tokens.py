"""Portal tokens (outbox/endpoints/portal_tokens.py): minted by an application, verified by the
portal. No database: a pure module (in [tool.mutmut])."""

from __future__ import annotations

import base64
import hmac
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


# --- found by the review of the module (each failed before its fix) ----------------------


def _signed(head: bytes, body: bytes, key: bytes | None = None) -> str:
    """A token with these exact header and claims bytes, correctly signed with KEY."""
    h, c = pt._b64(head), pt._b64(body)
    mac = hmac.digest(key if key is not None else raw(KEY), f"{h}.{c}".encode(), "sha256")
    return f"{h}.{c}.{pt._b64(mac)}"


HEAD = json.dumps({"alg": "HS256", "kid": pt.key_id(raw(KEY)), "typ": "JWT"}).encode()


# 1. Crash: a non-ASCII character in the claims part escapes as UnicodeEncodeError
#    (portal_tokens.py:174 encodes parts[1] to ASCII before it is checked, outside any try).
@pytest.mark.parametrize("bad", ["é", "\u0661", "\ud800", "\uff21"])
def test_a_non_ascii_claims_part_is_refused_not_a_crash(bad: str) -> None:
    head, body, sig = mint().split(".")
    with pytest.raises(pt.PortalTokenRefused) as e:
        verify(f"{head}.{body}{bad}.{sig}")
    assert e.value.reason == "malformed"


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_any_changed_character_of_any_alphabet_is_refused(data: st.DataObject) -> None:
    token = mint()
    at = data.draw(st.integers(0, len(token) - 1))
    char = data.draw(st.characters().filter(lambda c: c != token[at]))
    with pytest.raises(pt.PortalTokenRefused):
        verify(token[:at] + char + token[at + 1 :])


# 2. Duplicate members: json keeps the last, a first-wins reader of the same signed token
#    (a gateway, an audit pipeline, another language's verifier) sees another tenant.
@pytest.mark.parametrize(
    ("head", "body"),
    [
        (HEAD, json.dumps(claims(sub="acme")).encode()[:-1] + b', "sub": "globex"}'),
        (HEAD[:1] + b'"alg": "none", ' + HEAD[1:], json.dumps(claims()).encode()),
    ],
    ids=["sub-twice", "alg-twice"],  # the key id is random: not in an id (xdist's workers)
)
def test_a_duplicate_member_is_refused(head: bytes, body: bytes) -> None:
    with pytest.raises(pt.PortalTokenRefused):
        verify(_signed(head, body))


# 3. RFC 7515/7519: the header and claims are UTF-8; json.loads(bytes) also takes UTF-16/32
#    and a UTF-8 BOM, so several byte strings of one header verify.
@pytest.mark.parametrize("encoding", ["utf-16", "utf-32", "utf-8-sig"])
def test_a_header_not_in_utf8_is_refused(encoding: str) -> None:
    head = json.dumps(json.loads(HEAD)).encode(encoding)
    with pytest.raises(pt.PortalTokenRefused):
        verify(_signed(head, json.dumps(claims()).encode()))


# 4. PortalKeys(...) takes an empty or short key that PortalKeys.parse refuses; with it,
#    anyone mints a token (HMAC with the empty key).
def test_portal_keys_refuses_a_short_key_however_it_is_made() -> None:
    with pytest.raises(OutboxValidationError):
        pt.PortalKeys([b""])


# 5. portal_url: the rest of base_url is not checked.
def test_a_base_url_with_a_query_is_refused_rather_than_changed() -> None:
    # "…/portal?lang=de" made "…/portal?lang=de/#token=…": the query's value changed.
    with pytest.raises(OutboxValidationError, match="plain"):
        pt.portal_url("https://hooks.example.com/portal?lang=de", tenant="acme", key=KEY)


@pytest.mark.parametrize(
    "bad",
    [
        "https://hooks.example.com/portal\r\nSet-Cookie: a=b",  # header / mail injection
        "https://hooks.example.com/por tal",
        "https://hooks.example.com@evil.example/portal",  # userinfo: the host is evil.example
        # Browsers go to evil.example; urlsplit says hooks.example.com.
        "https://evil.example\\@hooks.example.com/portal",
    ],
)
def test_a_base_url_that_is_not_one_plain_url_is_refused(bad: str) -> None:
    with pytest.raises(OutboxValidationError):
        pt.portal_url(bad, tenant="acme", key=KEY)


# --- what mutation testing showed the tests above missed ---------------------------------


def _signed_raw(body: bytes, compact: bool = False) -> str:
    header = {"alg": "HS256", "kid": pt.key_id(raw(KEY)), "typ": "JWT"}
    h = pt._b64(pt._json(header) if compact else json.dumps(header).encode())
    c = pt._b64(body)
    return f"{h}.{c}.{pt._b64(hmac.digest(raw(KEY), f'{h}.{c}'.encode(), 'sha256'))}"


def test_portal_url_passes_read_only_ttl_and_schema_on() -> None:
    url = pt.portal_url(
        "https://h.example/p", tenant="acme", key=KEY, read_only=True, ttl=120, schema="billing"
    )
    access = pt.verify_portal_token(url.split("#token=")[1], key=KEY, schema="billing")
    assert not access.write
    assert access.expires <= datetime.now(UTC) + timedelta(seconds=121)
    url = pt.portal_url("https://h.example/p", tenant="acme", key=KEY)
    assert pt.verify_portal_token(url.split("#token=")[1], key=KEY).write


@pytest.mark.parametrize("claim", ["iat", "exp", "nbf"])
@pytest.mark.parametrize("kind", [float, str])
def test_each_time_claim_must_be_an_integer(claim: str, kind: type) -> None:
    c = claims(nbf=int(NOW.timestamp()))
    c[claim] = kind(c[claim])
    assert refused(forge(c)) == "claims"


def test_lifetimes_of_one_second_and_of_exactly_seven_days_verify() -> None:
    assert verify(mint(ttl=1)).expires == NOW + timedelta(seconds=1)
    assert verify(mint(ttl=timedelta(days=7))).tenant == "acme"


def test_the_leeway_boundaries_are_exact() -> None:
    iat = int(NOW.timestamp())
    assert refused(forge(claims(exp=iat + 600)), now=NOW + timedelta(seconds=660)) == "expired"
    assert refused(forge(claims(iat=iat + 60, exp=iat + 660))) == "not_yet"
    assert refused(forge(claims(nbf=iat + 60))) == "not_yet"


@pytest.mark.parametrize(("n", "ok"), [(15, False), (16, True), (64, True), (65, False)])
def test_jti_length_bounds(n: int, ok: bool) -> None:
    token = forge(claims(jti="A" * n))
    if ok:
        assert verify(token).token_id == "A" * n
    else:
        assert refused(token) == "claims"


@pytest.mark.parametrize("scope", ["read  write", "read\twrite", " read", "read\nwrite"])
def test_scope_words_are_separated_by_one_space(scope: str) -> None:
    assert refused(forge(claims(scope=scope))) == "claims"


@pytest.mark.parametrize("kid", [["x"], {"a": 1}, 7, None])
def test_a_kid_that_is_not_a_str_is_an_unknown_key(kid: Any) -> None:
    body = pt._b64(json.dumps(claims()).encode())
    head = pt._b64(json.dumps({"alg": "HS256", "kid": kid, "typ": "JWT"}).encode())
    assert refused(f"{head}.{body}.AAAA") == "unknown_key"


def test_signed_claims_that_are_not_a_json_object_are_refused_with_their_reason() -> None:
    assert refused(_signed_raw(b"not json")) == "malformed"
    assert refused(_signed_raw(b"[]")) == "claims"


def test_a_naive_now_or_an_empty_schema_is_refused() -> None:
    with pytest.raises(OutboxValidationError):
        verify(mint(), now=datetime(2026, 12, 7, 12, 0))
    with pytest.raises(OutboxValidationError):
        mint(schema="")


def test_key_id_is_a_fixed_function_of_the_key() -> None:
    # Other languages compute it from docs/portal.md: pin it.
    assert pt.key_id(bytes(32)) == "kfDGH-XW"


def test_our_json_is_sorted_and_compact() -> None:
    head, body, _ = mint().split(".")
    assert (
        pt._unb64(head) == b'{"alg":"HS256","kid":"%s","typ":"JWT"}' % pt.key_id(raw(KEY)).encode()
    )
    decoded = pt._unb64(body)
    assert (
        decoded == json.dumps(json.loads(decoded), sort_keys=True, separators=(",", ":")).encode()
    )


def test_new_portal_key_is_a_fresh_32_byte_key() -> None:
    a, b = pt.new_portal_key(), pt.new_portal_key()
    assert a.startswith("opk_") and len(raw(a)) == 32 and a != b


def test_a_bad_key_error_names_the_key_and_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(OutboxValidationError) as e:
        pt.PortalKeys.parse(f"{KEY},abc")
    assert e.value.field == "key" and "key 2 " in str(e.value)
    monkeypatch.setenv(pt.KEY_VARIABLE, "abc")
    with pytest.raises(OutboxValidationError) as e:
        pt.portal_token(tenant="acme")
    assert e.value.field == pt.KEY_VARIABLE and "key 1 " in str(e.value)


def test_a_token_of_at_most_max_token_bytes_is_read() -> None:
    sizes = {}
    for pad in range(2600, 3000):
        for compact in (False, True):
            body = json.dumps(claims()).encode()[:-1] + b" " * pad + b"}"
            token = _signed_raw(body, compact)
            sizes.setdefault(len(token), token)
    assert verify(sizes[pt.MAX_TOKEN_BYTES]).tenant == "acme"
    assert refused(sizes[pt.MAX_TOKEN_BYTES + 1]) == "malformed"
