"""Signed envelopes: round trips, every refusal reason, check order, tamper detection."""

from __future__ import annotations

import math
from typing import Any

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from test_messages import IDENTITIES, any_message, make_announce, make_manifest, make_task

from echo2.protocol import canonical, envelope, messages
from echo2.protocol.envelope import SIGN_PREFIX, ReplayGuard, open_envelope, peek_domain, seal
from echo2.protocol.errors import (
    BadSignature,
    DecodeError,
    Echo2Error,
    Expired,
    Replay,
    SchemaError,
    SignerNotAllowed,
    TooLarge,
    WrongDomain,
)
from echo2.protocol.messages import MESSAGE_TYPES, Announce, ErrorReply, HoldsVersion, Task

HUB, NODE, OTHER = IDENTITIES[0], IDENTITIES[1], IDENTITIES[2]
NOW = 1_700_000_000.0
NONCE = bytes(range(16))
ALL_TYPES = tuple(MESSAGE_TYPES.values())


def small_msg() -> HoldsVersion:
    return HoldsVersion(peer_id=NODE.peer_id, version=3, seconds=0.25)


def resign(body: dict[str, Any], identity: Any = NODE, prefix: bytes = SIGN_PREFIX) -> bytes:
    """Sign an arbitrary (possibly invalid) envelope body, to reach checks after the signature."""
    body = {k: v for k, v in body.items() if k != "s"}
    body["s"] = identity.sign(prefix + canonical.encode(body))
    return canonical.encode(body)


def body_of(msg: messages.Message, identity: Any = NODE, **over: Any) -> dict[str, Any]:
    env = canonical.decode(seal(identity, msg, now=NOW, nonce=NONCE), max_size=1 << 26)
    env.update(over)
    return env


def test_seal_open_round_trip() -> None:
    msg = make_task(node_id=NODE.peer_id)
    data = seal(HUB, msg, now=NOW, nonce=NONCE, ttl_s=30.0)
    v = open_envelope(data, Task, now=NOW + 1, replay=ReplayGuard())
    assert v.message == msg
    assert v.signer == HUB.peer_id
    assert (v.created, v.expires, v.nonce, v.raw) == (NOW, NOW + 30.0, NONCE, data)
    assert peek_domain(data) == Task.DOMAIN == "echo2/task/1.0.0"
    # any of several expected types
    assert open_envelope(data, (Announce, Task), now=NOW, replay=None).message == msg
    assert open_envelope(memoryview(data), ALL_TYPES, now=NOW, replay=None).message == msg


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(any_message)
def test_round_trip_every_message_type(msg: messages.Message) -> None:
    data = seal(NODE, msg, now=NOW)
    v = open_envelope(data, type(msg), now=NOW, replay=None)
    assert v.message == msg and v.signer == NODE.peer_id
    assert peek_domain(data) == msg.DOMAIN


def test_signed_bytes_are_canonical() -> None:
    peers = [i.peer_id for i in IDENTITIES]
    a = messages.BroadcastPlan(7, 1, {peers[1]: [peers[0]], peers[2]: [peers[1]]}, {peers[0]: [[peers[1]]]},
                               {peers[0]: "a:1", peers[1]: "b:2"}, NOW)  # fmt: skip
    b = messages.BroadcastPlan(7, 1, {peers[2]: [peers[1]], peers[1]: [peers[0]]}, {peers[0]: [[peers[1]]]},
                               {peers[1]: "b:2", peers[0]: "a:1"}, NOW)  # fmt: skip
    assert list(a.parents) != list(b.parents)
    ea, eb = seal(HUB, a, now=NOW, nonce=NONCE), seal(HUB, b, now=NOW, nonce=NONCE)
    assert ea == eb  # Ed25519 is deterministic, so identical bytes means identical signed bytes
    pa = canonical.decode(ea, max_size=1 << 20)["p"]
    assert pa == canonical.encode(a.to_wire()) == canonical.encode(b.to_wire())
    # a float field given as int signs the same bytes as the float
    assert seal(HUB, make_task(temperature=1), now=NOW, nonce=NONCE) == seal(
        HUB, make_task(temperature=1.0), now=NOW, nonce=NONCE
    )


# --- each refusal reason -----------------------------------------------------------------------


def test_too_large() -> None:
    data = seal(NODE, small_msg(), now=NOW)
    with pytest.raises(TooLarge, match="exceeds the limit"):
        open_envelope(data, HoldsVersion, now=NOW, replay=None, max_size=len(data) - 1)
    with pytest.raises(TooLarge):
        open_envelope(data + b"\x00" * HoldsVersion.MAX_SIZE, HoldsVersion, now=NOW, replay=None)
    # A small type may not ride under the limit of a larger expected type.
    fat = resign(body_of(ErrorReply("x", "y"), p=canonical.encode({"code": "x", "message": "m" * 10_000})))
    assert ErrorReply.MAX_SIZE < len(fat) < Task.MAX_SIZE
    with pytest.raises(TooLarge, match="error envelope"):
        open_envelope(fat, (ErrorReply, Task), now=NOW, replay=None)


def test_seal_refuses(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(SchemaError, match="Task.temperature"):
        seal(HUB, make_task(temperature=math.inf))
    with pytest.raises(SchemaError, match="ttl_s"):
        seal(HUB, make_task(), ttl_s=math.nan)
    with pytest.raises(SchemaError, match="ttl_s"):
        seal(HUB, make_task(), ttl_s=0.0)
    with pytest.raises(SchemaError, match="nonce"):
        seal(HUB, make_task(), nonce=b"short")
    with pytest.raises(SchemaError, match="not a top-level"):
        seal(HUB, messages.Completion(0, [], [], "stop"))  # type: ignore[arg-type]
    monkeypatch.setattr(ErrorReply, "MAX_SIZE", 200)
    seal(NODE, ErrorReply("c", "m" * 10))
    with pytest.raises(TooLarge, match="error envelope of"):
        seal(NODE, ErrorReply("c", "m" * 100))


@pytest.mark.parametrize(
    "data",
    [b"", b"\xc1", b"\x80\x80", msgpack.packb({"p": b"x", "d": "echo2/error/1.0.0"})],
    ids=["empty", "reserved", "trailing", "unsorted"],
)
def test_decode_errors(data: bytes) -> None:
    with pytest.raises(DecodeError):
        open_envelope(data, ErrorReply, now=NOW, replay=None)


def test_non_canonical_payload_is_a_decode_error() -> None:
    bad_payload = msgpack.packb({"message": "m", "code": "c"})  # keys unsorted
    with pytest.raises(DecodeError):
        open_envelope(resign(body_of(ErrorReply("c", "m"), p=bad_payload)), ErrorReply, now=NOW, replay=None)
    nan_payload = canonical.encode({"peer_id": NODE.peer_id, "seconds": 1.0, "version": 1})
    nan_payload = nan_payload.replace(canonical.encode(1.0), b"\xcb\x7f\xf8" + b"\x00" * 6)
    with pytest.raises(DecodeError, match="non-finite"):
        open_envelope(resign(body_of(small_msg(), p=nan_payload)), HoldsVersion, now=NOW, replay=None)


@pytest.mark.parametrize(
    "over,match",
    [
        ({"k": b"\x01" * 31}, "envelope.k"),
        ({"n": b"\x01" * 15}, "envelope.n"),
        ({"s": b"\x01" * 63}, "envelope.s"),
        ({"t": 1}, "envelope.t"),
        ({"x": "soon"}, "envelope.x"),
        ({"x": NOW - 1}, "expires before"),
        ({"d": 5}, "envelope.d"),
        ({"p": "text"}, "envelope.p"),
        ({"z": 1}, r"unknown field\(s\) \['z'\]"),
    ],
)
def test_envelope_schema_errors(over: dict[str, Any], match: str) -> None:
    body = body_of(small_msg(), **over)
    with pytest.raises(SchemaError, match=match):
        open_envelope(canonical.encode(body), HoldsVersion, now=NOW, replay=None)


def test_envelope_missing_field() -> None:
    body = body_of(small_msg())
    del body["n"]
    with pytest.raises(SchemaError, match=r"missing field\(s\) \['n'\]"):
        open_envelope(canonical.encode(body), HoldsVersion, now=NOW, replay=None)
    with pytest.raises(SchemaError, match="expected map"):
        open_envelope(canonical.encode([1, 2]), HoldsVersion, now=NOW, replay=None)


@pytest.mark.parametrize(
    "payload,match",
    [
        ({"peer_id": NODE.peer_id, "version": 1, "seconds": -1.0}, "HoldsVersion.seconds"),
        ({"peer_id": NODE.peer_id, "version": 1, "seconds": 1.0, "extra": 0}, "unknown field"),
        ({"peer_id": "nobody", "version": 1, "seconds": 1.0}, "HoldsVersion.peer_id"),
        ({"peer_id": NODE.peer_id, "version": 1}, "missing field"),
        ([1, 2, 3], "expected map"),
    ],
)
def test_payload_schema_errors(payload: Any, match: str) -> None:
    # validly signed: the schema check stands on its own
    data = resign(body_of(small_msg(), p=canonical.encode(payload)))
    with pytest.raises(SchemaError, match=match):
        open_envelope(data, HoldsVersion, now=NOW, replay=None)


def test_payload_oversized_list_and_string() -> None:
    w = make_announce(peer_id=NODE.peer_id).to_wire()
    cases: list[tuple[dict[str, Any], str]] = [
        ({"listen_addrs": ["a"] * 17}, "listen_addrs"),
        ({"engine": "e" * 65}, "engine"),
    ]
    for over, match in cases:
        data = resign(body_of(make_announce(), p=canonical.encode({**w, **over})))
        with pytest.raises(SchemaError, match=match):
            open_envelope(data, Announce, now=NOW, replay=None)


def test_negative_price_refused_in_envelope() -> None:
    w = make_announce().to_wire()
    data = resign(body_of(make_announce(), p=canonical.encode({**w, "price_usd_per_hour": -0.5})))
    with pytest.raises(SchemaError, match="price_usd_per_hour"):
        open_envelope(data, Announce, now=NOW, replay=None)


def test_wrong_domain() -> None:
    data = seal(NODE, small_msg(), now=NOW)
    with pytest.raises(WrongDomain, match="got a holds_version message"):
        open_envelope(data, Task, now=NOW, replay=None)
    with pytest.raises(WrongDomain, match="unknown domain 'echo2/holds_version/2.0.0'"):
        open_envelope(resign(body_of(small_msg(), d="echo2/holds_version/2.0.0")), HoldsVersion, now=NOW,
                      replay=None)  # fmt: skip
    # The domain is signed: a relabelled envelope fails the signature.
    relabelled = canonical.encode(body_of(ErrorReply("a", "b"), d=HoldsVersion.DOMAIN))
    with pytest.raises(Echo2Error):
        open_envelope(relabelled, HoldsVersion, now=NOW, replay=None)


def test_bad_signature() -> None:
    body = body_of(small_msg())
    body["s"] = bytes([body["s"][0] ^ 1]) + body["s"][1:]
    with pytest.raises(BadSignature):
        open_envelope(canonical.encode(body), HoldsVersion, now=NOW, replay=None)
    # signed by OTHER but claiming NODE's key
    forged = resign(body_of(small_msg()), identity=OTHER)
    with pytest.raises(BadSignature):
        open_envelope(forged, HoldsVersion, now=NOW, replay=None)
    # signature without the domain-separation prefix
    with pytest.raises(BadSignature):
        open_envelope(resign(body_of(small_msg()), prefix=b""), HoldsVersion, now=NOW, replay=None)
    # changing the payload breaks the signature
    other_payload = canonical.encode(HoldsVersion(NODE.peer_id, 4, 0.25).to_wire())
    with pytest.raises(BadSignature):
        open_envelope(
            canonical.encode(body_of(small_msg(), p=other_payload)), HoldsVersion, now=NOW, replay=None
        )


def test_signer_not_allowed() -> None:
    data = seal(NODE, make_task(), now=NOW)
    calls: list[tuple[str, type]] = []

    def hub_only(signer: str, cls: type) -> bool:
        calls.append((signer, cls))
        return signer == HUB.peer_id

    with pytest.raises(SignerNotAllowed, match=f"{NODE.peer_id} may not send task"):
        open_envelope(data, Task, now=NOW, replay=None, allowed=hub_only)
    assert calls == [(NODE.peer_id, Task)]
    open_envelope(seal(HUB, make_task(), now=NOW), Task, now=NOW, replay=None, allowed=hub_only)


def test_expired_and_future_dated() -> None:
    data = seal(NODE, small_msg(), now=NOW, ttl_s=60.0)
    open_envelope(data, HoldsVersion, now=NOW + 60.0, replay=None)
    with pytest.raises(Expired, match="expired"):
        open_envelope(data, HoldsVersion, now=NOW + 60.5, replay=None)
    open_envelope(data, HoldsVersion, now=NOW - 30.0, replay=None)
    with pytest.raises(Expired, match="in the future"):
        open_envelope(data, HoldsVersion, now=NOW - 31.0, replay=None)
    with pytest.raises(Expired, match="in the future"):
        open_envelope(data, HoldsVersion, now=NOW - 5.0, replay=None, clock_skew_s=1.0)
    # A lifetime longer than the replay window could outlive its nonce record.
    long = seal(NODE, small_msg(), now=NOW, ttl_s=3600.0)
    open_envelope(long, HoldsVersion, now=NOW, replay=None)
    with pytest.raises(Expired, match="replay window"):
        open_envelope(long, HoldsVersion, now=NOW, replay=ReplayGuard(window_s=600.0))


def test_replay() -> None:
    guard = ReplayGuard()
    data = seal(NODE, small_msg(), now=NOW)
    open_envelope(data, HoldsVersion, now=NOW, replay=guard)
    with pytest.raises(Replay, match="already seen"):
        open_envelope(data, HoldsVersion, now=NOW + 1, replay=guard)
    # same nonce, other signer: independent
    open_envelope(seal(OTHER, small_msg(), now=NOW, nonce=open_envelope(data, HoldsVersion, now=NOW,
                                                                       replay=None).nonce),
                  HoldsVersion, now=NOW, replay=guard)  # fmt: skip
    # a fresh seal of the same message has a fresh nonce
    open_envelope(seal(NODE, small_msg(), now=NOW), HoldsVersion, now=NOW, replay=guard)


def test_replay_guard_memory_is_bounded() -> None:
    g = ReplayGuard(window_s=100.0, max_entries=3)
    for i in range(3):
        g.check_and_add("a", bytes([i]) * 16, NOW + 10 + i, NOW)
    assert len(g) == 3
    with pytest.raises(Replay, match="cache full"):
        g.check_and_add("a", b"\x09" * 16, NOW + 10, NOW)
    g.check_and_add("a", b"\x09" * 16, NOW + 50, NOW + 10.5)  # first entry expired and was forgotten
    assert len(g) == 3
    with pytest.raises(Replay, match="already seen"):
        g.check_and_add("a", b"\x01" * 16, NOW + 11, NOW + 10.5)
    g.check_and_add("b", b"\x01" * 16, NOW + 20, NOW + 12.5)  # a/1 and a/2 expired and forgotten
    assert len(g) == 2
    with pytest.raises(Replay, match="replay window"):
        g.check_and_add("c", b"\x00" * 16, NOW + 1000, NOW)


# --- check order -------------------------------------------------------------------------------


def test_check_order() -> None:
    # Issue 15 (A2) moved the payload's decoding and schema after the signature, signer, expiry
    # and replay checks: only the envelope's own fields are read before the signature.
    guard = ReplayGuard()
    good = seal(NODE, small_msg(), now=NOW)
    open_envelope(good, HoldsVersion, now=NOW, replay=guard)
    body = canonical.decode(good, max_size=1 << 20)
    bad_sig = canonical.encode({**body, "s": bytes(64)})
    never = lambda s, c: False  # noqa: E731
    # size before everything
    with pytest.raises(TooLarge):
        open_envelope(b"\xc1" * 10_000, HoldsVersion, now=NOW, replay=guard)
    # the envelope's own fields before the signature
    with pytest.raises(SchemaError, match="envelope.k"):
        open_envelope(canonical.encode({**body, "s": bytes(64), "k": b"\x01"}), HoldsVersion, now=NOW, replay=guard)
    # domain before signature
    with pytest.raises(WrongDomain):
        open_envelope(bad_sig, Task, now=NOW, replay=guard)
    # signature before the payload's schema (the old order checked the payload first)
    bad_both = canonical.encode({**body, "s": bytes(64), "p": canonical.encode({"x": 1})})
    with pytest.raises(BadSignature):
        open_envelope(bad_both, HoldsVersion, now=NOW, replay=guard)
    # signature before signer / expiry / replay
    with pytest.raises(BadSignature):
        open_envelope(bad_sig, HoldsVersion, now=NOW + 1e6, replay=guard, allowed=never)
    # signer before expiry / replay
    with pytest.raises(SignerNotAllowed):
        open_envelope(good, HoldsVersion, now=NOW + 1e6, replay=guard, allowed=never)
    # expiry before replay
    with pytest.raises(Expired):
        open_envelope(good, HoldsVersion, now=NOW + 1e6, replay=guard)
    with pytest.raises(Replay):
        open_envelope(good, HoldsVersion, now=NOW, replay=guard)
    # signer, expiry and replay before the payload's schema: authentic garbage is refused last
    signed_garbage = resign({**body, "n": b"\x07" * 16, "p": canonical.encode({"x": 1})})
    with pytest.raises(SignerNotAllowed):
        open_envelope(signed_garbage, HoldsVersion, now=NOW, replay=guard, allowed=never)
    with pytest.raises(Expired):
        open_envelope(signed_garbage, HoldsVersion, now=NOW + 1e6, replay=guard)
    with pytest.raises(SchemaError, match="HoldsVersion"):
        open_envelope(signed_garbage, HoldsVersion, now=NOW, replay=guard)
    with pytest.raises(Replay):
        open_envelope(signed_garbage, HoldsVersion, now=NOW, replay=guard)


def test_refused_envelope_does_not_burn_its_nonce() -> None:
    guard = ReplayGuard()
    data = seal(NODE, small_msg(), now=NOW)
    with pytest.raises(SignerNotAllowed):
        open_envelope(data, HoldsVersion, now=NOW, replay=guard, allowed=lambda s, c: False)
    assert len(guard) == 0
    open_envelope(data, HoldsVersion, now=NOW, replay=guard)


# --- tampering ---------------------------------------------------------------------------------


def test_every_flipped_byte_is_detected() -> None:
    data = seal(NODE, ErrorReply("e", "m"), now=NOW, nonce=NONCE)
    assert len(data) < 300
    open_envelope(data, ErrorReply, now=NOW, replay=None)
    for pos in range(len(data)):
        for mask in (0x01, 0x02, 0x04, 0x08, 0x10, 0x20, 0x40, 0x80, 0xFF):
            bad = bytearray(data)
            bad[pos] ^= mask
            with pytest.raises(Echo2Error):
                open_envelope(bytes(bad), ErrorReply, now=NOW, replay=None)
    # truncation and extension too
    for cut in range(len(data)):
        with pytest.raises(Echo2Error):
            open_envelope(data[:cut], ErrorReply, now=NOW, replay=None)
    with pytest.raises(DecodeError):
        open_envelope(data + b"\x00", ErrorReply, now=NOW, replay=None)


def test_large_manifest_envelope() -> None:
    m = make_manifest(artifacts={"tokenizer.json": b"t" * (2 * 1024 * 1024)})
    data = seal(HUB, m, now=NOW)
    assert open_envelope(data, messages.Manifest, now=NOW, replay=None).message == m
    bad = bytearray(data)
    bad[len(bad) // 2] ^= 0x10  # inside the artifact bytes
    with pytest.raises(BadSignature):
        open_envelope(bytes(bad), messages.Manifest, now=NOW, replay=None)


# --- peek ----------------------------------------------------------------------------------------


def test_peek_domain() -> None:
    assert peek_domain(seal(HUB, make_manifest(), now=NOW)) == messages.Manifest.DOMAIN
    for bad in (b"", b"\xc1", canonical.encode([1]), canonical.encode({"a": 1}), b"\x87\xa1d"):
        with pytest.raises(DecodeError):
            peek_domain(bad)
    with pytest.raises(SchemaError):
        peek_domain(b"\x87\xa1d\x05")
    with pytest.raises(TooLarge):
        peek_domain(b"\x00" * (envelope.MAX_ENVELOPE_SIZE + 1))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(msg=any_message)
def test_signed_bytes_cut_from_the_envelope_equal_the_reencoded_body(msg: messages.Message) -> None:
    # The signature is checked over bytes cut from the envelope as received; they must be exactly
    # what the signer signed: the prefix and the canonical map without "s".
    for payload_len in (0, 300, 70_000):  # bin8, bin16 and bin32 length forms of "p"
        data = canonical.encode({**body_of(msg), "p": b"\x01" * payload_len})
        body = canonical.decode(data, max_size=1 << 26)
        del body["s"]
        assert envelope._signed_bytes(data) == SIGN_PREFIX + canonical.encode(body)
    data = seal(NODE, msg, now=NOW)
    body = canonical.decode(data, max_size=1 << 26)
    del body["s"]
    assert envelope._signed_bytes(memoryview(data)) == SIGN_PREFIX + canonical.encode(body)


# --- issue 15, A2: a frame nobody trusted signed is never decoded -------------------------------


def _hostile_body(payload_len: int) -> dict[str, Any]:
    """A 'Result' envelope body whose payload is an array of empty maps (the costliest to decode: a
    dict per byte), with a zero signature and a real-looking key."""
    n = payload_len - 5
    payload = b"\xdd" + n.to_bytes(4, "big") + b"\x80" * n
    return {"d": messages.Result.DOMAIN, "k": NODE.public_bytes, "n": NONCE, "p": payload,
            "s": bytes(64), "t": NOW, "x": NOW + 60.0}  # fmt: skip


def _no_decoding(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*a: Any, **kw: Any) -> Any:
        raise AssertionError("the payload was decoded before its signature was checked")

    monkeypatch.setattr(envelope.fastdecode, "decode_payload", refuse)
    monkeypatch.setattr(envelope.canonical, "decode", refuse)


def _peak_bytes(call: Any) -> int:
    """Peak traced memory ``call()`` allocates on top of what was allocated before it."""
    import tracemalloc

    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        call()
        return tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()


def _refused(exc: type[Exception], data: Any, **kw: Any) -> Any:
    def call() -> None:
        with pytest.raises(exc):
            open_envelope(data, messages.Result, **{"now": NOW, "replay": None, **kw})

    return call


def test_a2_bad_signature_never_decodes_the_payload(monkeypatch: pytest.MonkeyPatch) -> None:
    frame = canonical.encode(_hostile_body(4 * 1024 * 1024))
    _no_decoding(monkeypatch)
    for data in (frame, memoryview(frame), bytearray(frame)):
        peak = _peak_bytes(_refused(BadSignature, data, replay=ReplayGuard()))
        assert peak < 2 * len(frame), f"opening a {len(frame)} byte frame peaked at {peak} bytes"
    # an unknown field holding a big nested value is stepped over, not built
    n = 1_000_000
    nested = b"\x88" + canonical.encode(_hostile_body(64))[1:] + b"\xa1z\xdd" + n.to_bytes(4, "big") + b"\x80" * n
    with pytest.raises(SchemaError, match=r"unknown field\(s\) \['z'\]"):
        open_envelope(nested, messages.Result, now=NOW, replay=None)
    peak = _peak_bytes(_refused(SchemaError, nested))
    assert peak < 2 * len(nested), f"opening a {len(nested)} byte frame peaked at {peak} bytes"


def test_a2_nothing_but_the_signature_before_the_signature(monkeypatch: pytest.MonkeyPatch) -> None:
    # A frame signed by a key nobody allowed: refused after the signature check, still undecoded.
    frame = resign({**_hostile_body(1024 * 1024), "k": OTHER.public_bytes}, identity=OTHER)
    _no_decoding(monkeypatch)
    with pytest.raises(SignerNotAllowed):
        open_envelope(frame, messages.Result, now=NOW, replay=ReplayGuard(), allowed=lambda s, c: False)
    with pytest.raises(Expired):
        open_envelope(frame, messages.Result, now=NOW + 3600, replay=ReplayGuard())
    guard = ReplayGuard()
    guard.check_and_add(OTHER.peer_id, NONCE, NOW + 60, NOW)
    with pytest.raises(Replay):
        open_envelope(frame, messages.Result, now=NOW, replay=guard)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(msg=any_message)
def test_fixed_layout_reader_agrees_with_the_general_reader(msg: messages.Message) -> None:
    # The copy-free reader of seal()'s layout must accept exactly what the general reader accepts
    # there, with the same fields: bin8/16/32 payloads, fixstr/str8/str16 domains.
    for payload_len, domain in ((0, msg.DOMAIN), (300, "d" * 40), (70_000, "é" * 128)):
        data = canonical.encode({**body_of(msg), "p": b"\x01" * payload_len, "d": domain})
        mv = memoryview(data)
        assert envelope._read_fixed(mv) == envelope._read_any(mv)
    data = seal(NODE, msg, now=NOW)
    assert envelope._read_fixed(memoryview(data)) == envelope._read_any(memoryview(data))


def test_fixed_layout_reader_never_accepts_what_the_general_reader_refuses() -> None:
    data = seal(NODE, ErrorReply("e", "m" * 40), now=NOW, nonce=NONCE)
    for pos in range(len(data)):
        for mask in (0x01, 0x10, 0x80, 0xFF):
            bad = bytearray(data)
            bad[pos] ^= mask
            mv = memoryview(bytes(bad))
            fixed = envelope._read_fixed(mv)
            if fixed is not None:
                assert fixed == envelope._read_any(mv)
    for cut in range(len(data)):
        assert envelope._read_fixed(memoryview(data[:cut])) is None


@pytest.mark.parametrize("size", [0, 300, 4096, 4097, 70_000])
def test_both_signing_paths_give_the_rfc8032_signature(size: int) -> None:
    """Identity.sign takes libsodium for small data and OpenSSL above: Ed25519 is deterministic,
    so both must give exactly the signature OpenSSL gives, and it verifies."""
    from echo2.protocol.identity import Identity, verify_signature

    ident = Identity.from_seed(bytes(range(32)))
    data = bytes((i * 7) & 0xFF for i in range(size))
    sig = ident.sign(data)
    assert sig == ident.private_key.sign(data)
    verify_signature(ident.public_bytes, sig, data)
