"""Admission modes and join tokens with real Ed25519 hub identities."""

from __future__ import annotations

import base64
from pathlib import Path

import pytest

from echo2.learner_hub.admission import (
    TOKEN_PREFIX,
    AdmissionPolicy,
    JoinTokenError,
    make_join_token,
    parse_duration,
    verify_join_token,
)
from echo2.learner_hub.store import HubStore
from echo2.protocol import canonical
from echo2.protocol.identity import Identity

HUB = Identity.from_seed(b"\x01" * 32)
OTHER_HUB = Identity.from_seed(b"\x02" * 32)
NODE = Identity.from_seed(b"\x03" * 32).peer_id
NODE2 = Identity.from_seed(b"\x04" * 32).peer_id
NOW = 1_700_000_000.0


def policy(mode: str, **kw: object) -> AdmissionPolicy:
    return AdmissionPolicy(mode, hub_peer_id=HUB.peer_id, **kw)  # type: ignore[arg-type]


def test_parse_duration() -> None:
    assert parse_duration("7d") == 7 * 86400
    assert parse_duration("12h") == 43200
    assert parse_duration("30m") == 1800
    assert parse_duration("1d12h") == 86400 + 43200
    assert parse_duration("90") == 90
    assert parse_duration(" 2W ") == 2 * 604800
    for bad in ("", "x", "7 d", "d7", "7dd", "-1h", "0h", "1y", "1h30"):
        with pytest.raises(ValueError):
            parse_duration(bad)


def test_open_admits_all_but_banned() -> None:
    bans = {NODE2: "3 log-prob mismatches"}
    p = policy("open", ban_reason=bans.get)
    d = p.decide(NODE, "", NOW)
    assert d.admitted and d.code == "open"
    d = p.decide(NODE2, "", NOW)
    assert not d.admitted and d.code == "banned" and "3 log-prob mismatches" in d.reason


def test_allowlist_config_and_store(tmp_path: Path) -> None:
    with HubStore.in_dir(tmp_path) as store:
        p = policy("allowlist", allowlist={NODE}, ban_reason=store.ban_reason, is_allowed=store.is_allowed)
        assert p.decide(NODE, "", NOW).admitted
        d = p.decide(NODE2, "", NOW)
        assert not d.admitted and d.code == "not_allowlisted" and f"echo2 hub admit {NODE2}" in d.reason
        store.allow(NODE2, NOW)  # `echo2 hub admit` while the hub runs
        assert p.decide(NODE2, "", NOW).admitted
        # a valid token does not open an allowlist-only hub
        assert not p.decide("12D3KooWnobody", make_join_token(HUB, ttl_s=60, now=NOW), NOW).admitted
        store.ban(NODE, "forged result: task hash mismatch", NOW)  # a ban beats the allowlist
        d = p.decide(NODE, "", NOW)
        assert not d.admitted and d.code == "banned" and "task hash mismatch" in d.reason


def test_token_valid_expired_missing() -> None:
    p = policy("token")
    tok = make_join_token(HUB, ttl_s=parse_duration("7d"), now=NOW)
    assert tok.startswith(TOKEN_PREFIX)
    assert p.decide(NODE, tok, NOW + 3600).admitted
    assert p.decide(NODE2, tok, NOW + 6 * 86400).admitted  # a fleet invite: many nodes, until expiry
    d = p.decide(NODE, tok, NOW + 7 * 86400 + 1)
    assert not d.admitted and d.code == "bad_join_token" and "expired" in d.reason
    d = p.decide(NODE, "", NOW)
    assert not d.admitted and d.code == "token_required" and "--join-token" in d.reason
    assert policy("token", allowlist={NODE}).decide(NODE, "", NOW).admitted


def test_token_forged_and_other_hub() -> None:
    p = policy("token")
    good = make_join_token(HUB, ttl_s=600, now=NOW)
    # another hub's token, honestly naming that hub
    d = p.decide(NODE, make_join_token(OTHER_HUB, ttl_s=600, now=NOW), NOW)
    assert not d.admitted and "another hub" in d.reason
    # claims naming this hub but signed by someone else
    claims = {"hub": HUB.peer_id, "exp": NOW + 600, "iat": NOW, "nonce": b"n" * 16, "scope": "join"}
    raw = canonical.encode(claims)
    sig = OTHER_HUB.sign(b"echo2-join-token\x00v1\x00" + raw)
    b64 = lambda b: base64.urlsafe_b64encode(b).rstrip(b"=").decode()  # noqa: E731
    forged = f"{TOKEN_PREFIX}{b64(raw)}.{b64(sig)}"
    d = p.decide(NODE, forged, NOW)
    assert not d.admitted and "signature" in d.reason
    # a genuine signature with an extended expiry spliced in
    _, gsig = good[len(TOKEN_PREFIX) :].split(".")
    longer = canonical.encode({**claims, "exp": NOW + 10**7})
    d = p.decide(NODE, f"{TOKEN_PREFIX}{b64(longer)}.{gsig}", NOW)
    assert not d.admitted and "signature" in d.reason
    # a signature over the same claims for another purpose does not verify as a join token
    other_purpose = f"{TOKEN_PREFIX}{b64(raw)}.{b64(HUB.sign(raw))}"
    assert not p.decide(NODE, other_purpose, NOW).admitted


@pytest.mark.parametrize(
    "token",
    ["garbage", TOKEN_PREFIX, TOKEN_PREFIX + "a.b.c", TOKEN_PREFIX + "!!.??", TOKEN_PREFIX + "AAAA.AAAA", "e2jt1." + "A" * 5000],
)
def test_token_garbage_refused_cleanly(token: str) -> None:
    d = policy("token").decide(NODE, token, NOW)
    assert not d.admitted and d.code == "bad_join_token" and d.reason


def test_token_bound_to_peer_and_wrong_scope() -> None:
    tok = make_join_token(HUB, ttl_s=600, now=NOW, peer_id=NODE)
    p = policy("token")
    assert p.decide(NODE, tok, NOW).admitted
    assert "another node" in p.decide(NODE2, tok, NOW).reason
    raw = canonical.encode({"hub": HUB.peer_id, "exp": NOW + 600, "iat": NOW, "nonce": b"n" * 16, "scope": "admin"})
    b64 = lambda b: base64.urlsafe_b64encode(b).rstrip(b"=").decode()  # noqa: E731
    with pytest.raises(JoinTokenError, match="scope"):
        verify_join_token(f"{TOKEN_PREFIX}{b64(raw)}.{b64(HUB.sign(b'echo2-join-token' + bytes(1) + b'v1' + bytes(1) + raw))}", HUB.peer_id, NOW)


def test_bad_mode() -> None:
    with pytest.raises(ValueError):
        policy("closed")
