"""Expiring tokens and signed requests (fedrl.credentials): pure functions, no server."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fedrl.credentials import (
    CredentialError,
    ReplayGuard,
    ReplayWindowFull,
    check_body,
    new_secret,
    sign_request,
    token_for,
    verify_request,
)

SECRET = new_secret()
NOW = 1_800_000_000.0


def signed(
    method="GET", path="/catalog", body=None, ttl_s=3600.0, now=NOW, principal="node-1", secret=SECRET
):
    return sign_request(principal, token_for(secret, principal, ttl_s, now=now), method, path, body, now=now)


def test_a_signed_request_opens_once():
    guard = ReplayGuard()
    headers = signed()
    assert verify_request(SECRET, headers, "GET", "/catalog", guard, now=NOW + 1) == "node-1"
    with pytest.raises(CredentialError, match="replayed"):
        verify_request(SECRET, headers, "GET", "/catalog", guard, now=NOW + 2)


def test_tokens_expire_and_times_outside_the_skew_are_refused():
    with pytest.raises(CredentialError, match="expired 10 s ago"):
        verify_request(SECRET, signed(ttl_s=-10), "GET", "/catalog", ReplayGuard(), now=NOW)
    stale = signed(now=NOW - 400)  # its token is still valid, the request is not
    with pytest.raises(CredentialError, match=r"-400 s from the store's clock"):
        verify_request(SECRET, stale, "GET", "/catalog", ReplayGuard(), now=NOW)


@pytest.mark.parametrize(
    "method, path, secret, why",
    [
        ("PUT", "/catalog", SECRET, "another method"),
        ("GET", "/catalog?x=1", SECRET, "another path"),
        ("GET", "/catalog", new_secret(), "another store's secret"),
    ],
    ids=["method", "path", "secret"],  # a random secret in an id differs between xdist workers
)
def test_a_signature_binds_method_path_and_secret(method, path, secret, why):
    with pytest.raises(CredentialError, match="does not verify"):
        verify_request(secret, signed(), method, path, ReplayGuard(), now=NOW)


@settings(max_examples=200, deadline=None)
@given(
    field=st.sampled_from(
        [
            "X-Principal",
            "X-Fedrl-Expires",
            "X-Fedrl-Time",
            "X-Fedrl-Nonce",
            "X-Fedrl-Body-SHA256",
            "Authorization",
        ]
    ),
    value=st.text(max_size=80),
)
def test_any_changed_header_is_refused(field, value):
    headers = signed(body=b'{"a": 1}', method="POST")
    if headers[field] == value:
        return
    with pytest.raises(CredentialError):
        verify_request(SECRET, {**headers, field: value}, "POST", "/catalog", ReplayGuard(), now=NOW)


def test_the_body_is_bound_to_the_signature():
    headers = signed(method="POST", body=b'{"refs": []}')
    check_body(headers, b'{"refs": []}')
    with pytest.raises(CredentialError, match="not the one"):
        check_body(headers, b'{"refs": [1]}')
    with pytest.raises(CredentialError, match="not the one"):
        check_body(signed(method="PUT"), b"a body sent where none was signed")


def test_the_replay_guard_is_bounded_and_forgets_what_the_window_forgets():
    guard = ReplayGuard(window_s=300, max_nonces=3)
    for i in range(3):
        guard.admit(f"{i:016d}", NOW, NOW)
    with pytest.raises(ReplayWindowFull):
        guard.admit("3" * 16, NOW, NOW + 1)  # all three are still inside the window
    guard.admit("3" * 16, NOW + 301, NOW + 301)  # the old ones can never be replayed now: dropped
    assert len(guard.seen) == 1
    with pytest.raises(CredentialError, match="16-64"):
        guard.admit("short", NOW, NOW)
