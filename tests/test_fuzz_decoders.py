"""Fuzzing every decoder of network input: only echo2 errors may escape, and nothing hangs.

Inputs: random bytes, mutated valid envelopes, mutated payloads re-signed (so the payload decoder
and schema are reached past the signature), and structurally mutated wire maps. The default run
is about 1,000 cases; the ``slow`` variants run well over 10,000.
"""

from __future__ import annotations

import random
from typing import Any

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_canonical import values
from test_messages import IDENTITIES, any_message, make_announce, make_manifest, make_result, make_task

from echo2.protocol import canonical, fastdecode, messages
from echo2.protocol.envelope import SIGN_PREFIX, ReplayGuard, open_envelope, peek_domain, seal
from echo2.protocol.errors import Echo2Error, SchemaError
from echo2.protocol.messages import MESSAGE_TYPES, RECORD_TYPES

NOW = 1_700_000_000.0
ALL_TYPES = tuple(MESSAGE_TYPES.values())
SIGNER = IDENTITIES[0]
PEER = SIGNER.peer_id
MAX = 1 << 26


def _fast(n: int) -> settings:
    return settings(
        max_examples=n,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
        database=None,
    )


def corpus() -> list[bytes]:
    msgs: list[messages.Message] = [
        make_task(),
        make_announce(),
        make_result(),
        messages.PackedResult("t-1", b"\x01" * 32, PEER, 3, [messages.PackedCompletion(0, b"\x05\x00\x00\x00", b"\x00\x00\x00\xbf", "stop")], NOW, 1.5, 1),
        make_manifest(),
        messages.Heartbeat(PEER, 5, [1, 2], 1, 3),
        messages.AdmissionRequest(PEER, "tok", make_announce()),
        messages.AdmissionDecision(PEER, False, "full", "127.0.0.1:9", -1, 2),
        messages.TaskDecline("t-1", b"\x01" * 32, PEER, "busy", "queue full"),
        messages.BroadcastPlan(3, 1, {PEER: [IDENTITIES[1].peer_id]}, {PEER: [[PEER]]}, {PEER: "a:1"}, NOW),
        messages.ChunkHave(PEER, 3, b"\xf0\x01"),
        messages.ChunkRequest(3, [0, 5, 9]),
        messages.HoldsVersion(PEER, 3, 1.0),
        messages.HoldsChallenge(PEER, 3, b"\x05" * 16, 2, 4096, 65536),
        messages.HoldsProof(PEER, 3, b"\x05" * 16, b"\x06" * 32),
        messages.RelayReport(PEER, IDENTITIES[1].peer_id, 3, 7, b"\x03" * 32, b"\x04" * 32),
        messages.ErrorReply("schema", "bad"),
        messages.ProbeReply(PEER, b"\x02" * 16, NOW, True, "dialled back", "127.0.0.1:9"),
        messages.Receipt(PEER, IDENTITIES[1].peer_id, ["t-1"], 1, 4, 32, 100_000, NOW, 1, 4, 32, 7),
        messages.Receipt(PEER, IDENTITIES[1].peer_id, [], 0, 0, 0, 100_000, NOW, 1, 4, 32, 9),  # a statement
        messages.NodePause(PEER, True, "hours", "outside the allowed hours", NOW),
        messages.ResultBatch(PEER, [seal(SIGNER, make_result(), now=NOW, ttl_s=60.0), b"\x00" * 8]),
        messages.BatchAck(PEER, [messages.BatchVerdict(True, "ok", "", b"\x01" * 40),
                                 messages.BatchVerdict(False, "stale", "too old", b"")]),
        messages.ChannelOffer(PEER, IDENTITIES[1].peer_id, "127.0.0.1:9", 32, 1 << 20),
        messages.TaskBundle([make_task(), make_task(task_id="t-2", prompts=[[9]])]),
    ]
    assert {type(m) for m in msgs} == set(ALL_TYPES)
    return [seal(SIGNER, m, now=NOW, ttl_s=60.0) for m in msgs]


CORPUS = corpus()
INTERESTING = [0x00, 0x01, 0x7F, 0x80, 0x90, 0xA0, 0xC0, 0xC1, 0xC2, 0xC3, 0xC4, 0xC6, 0xCA, 0xCB,
               0xCF, 0xD3, 0xD4, 0xD9, 0xDB, 0xDC, 0xDD, 0xDE, 0xDF, 0xE0, 0xFF]  # fmt: skip


def fuzz_one(data: bytes, guard: ReplayGuard | None = None) -> None:
    """Feed ``data`` to every decoder; any non-echo2 exception propagates and fails the test."""
    check_fast_decode(data)
    try:
        check_fast_decode(canonical.decode(data, max_size=MAX)["p"])
    except (Echo2Error, TypeError, KeyError):
        pass
    try:
        obj = canonical.decode(data, max_size=MAX)
    except Echo2Error:
        obj = None
    else:
        check_from_wire(obj)
    try:
        open_envelope(data, ALL_TYPES, now=NOW, replay=guard)
    except Echo2Error:
        pass
    try:
        peek_domain(data)
    except Echo2Error:
        pass


def _outcome(fn: Any) -> Any:
    try:
        return ("ok", fn())
    except Echo2Error as exc:
        return (type(exc).__name__, exc.message)


def check_fast_decode(payload: bytes) -> None:
    """The fast payload decoder accepts and refuses exactly like the reference, word for word."""
    for cls in RECORD_TYPES:
        fast = _outcome(lambda c=cls: fastdecode.decode_payload(c, payload, max_size=MAX))
        ref = _outcome(lambda c=cls: c.from_wire(canonical.decode(payload, max_size=MAX)))
        assert fast == ref, cls.__name__


def check_from_wire(obj: Any) -> None:
    for cls in RECORD_TYPES:
        try:
            cls.from_wire(obj)
        except SchemaError:
            pass


def resign(data: bytes, payload: bytes) -> bytes:
    """A valid envelope with ``payload`` substituted (the signature is correct again)."""
    body = canonical.decode(data, max_size=MAX)
    body["p"] = payload
    del body["s"]
    body["s"] = SIGNER.sign(SIGN_PREFIX + canonical.encode(body))
    return canonical.encode(body)


def mutate(rnd: random.Random, data: bytes) -> bytes:
    b = bytearray(data)
    for _ in range(rnd.randint(1, 4)):
        op = rnd.randrange(6)
        pos = rnd.randrange(len(b) + 1)
        if op == 0 and pos < len(b):
            b[pos] ^= 1 << rnd.randrange(8)
        elif op == 1 and pos < len(b):
            b[pos] = rnd.choice(INTERESTING)
        elif op == 2:
            b[pos:pos] = bytes([rnd.choice(INTERESTING)])
        elif op == 3 and pos < len(b):
            del b[pos : pos + rnd.randint(1, 8)]
        elif op == 4:
            del b[pos:]
        else:
            start = rnd.randrange(len(b) + 1)
            b[pos:pos] = b[start : start + rnd.randint(1, 16)]
    return bytes(b)


def run_mutations(seed: int, n: int) -> None:
    rnd = random.Random(seed)
    guard = ReplayGuard()
    for _ in range(n):
        env = rnd.choice(CORPUS)
        if rnd.random() < 0.5:
            fuzz_one(mutate(rnd, env), guard)
        else:
            payload = canonical.decode(env, max_size=MAX)["p"]
            fuzz_one(resign(env, mutate(rnd, payload)), guard)


def mutate_wire(data: st.DataObject, obj: Any, depth: int = 0) -> Any:
    """Replace, drop or add one thing somewhere inside a wire value."""
    if isinstance(obj, dict) and obj and depth < 6 and data.draw(st.booleans()):
        key = data.draw(st.sampled_from(sorted(obj)))
        out = dict(obj)
        action = data.draw(st.sampled_from(["descend", "drop", "add"]))
        if action == "descend":
            out[key] = mutate_wire(data, obj[key], depth + 1)
        elif action == "drop":
            del out[key]
        else:
            out[data.draw(st.text(max_size=8))] = data.draw(values)
        return out
    if isinstance(obj, list) and obj and depth < 6 and data.draw(st.booleans()):
        i = data.draw(st.integers(0, len(obj) - 1))
        out_l = list(obj)
        out_l[i] = mutate_wire(data, obj[i], depth + 1)
        return out_l
    return data.draw(values)


# --- the default (fast) run: about 1,000 cases --------------------------------------------------


@pytest.mark.timeout(60)
@_fast(200)
@given(st.binary(max_size=600))
def test_random_bytes(data: bytes) -> None:
    fuzz_one(data)


@pytest.mark.timeout(60)
@_fast(200)
@given(st.sampled_from(CORPUS), st.randoms(use_true_random=False))
def test_mutated_envelopes(env: bytes, rnd: random.Random) -> None:
    fuzz_one(mutate(rnd, env))


@pytest.mark.timeout(60)
@_fast(150)
@given(values)
def test_random_values_to_every_from_wire(v: Any) -> None:
    check_from_wire(v)
    fuzz_one(resign(CORPUS[0], canonical.encode(v)))


@pytest.mark.timeout(60)
@_fast(150)
@given(any_message, st.data())
def test_structurally_mutated_messages(msg: messages.Message, data: st.DataObject) -> None:
    wire = mutate_wire(data, msg.to_wire())
    try:
        type(msg).from_wire(wire)
    except SchemaError:
        pass
    try:
        payload = canonical.encode(wire)
    except SchemaError:
        return
    fuzz_one(resign(CORPUS[0], payload))


@pytest.mark.timeout(60)
def test_seeded_mutations() -> None:
    run_mutations(seed=1, n=300)


def test_fast_path_taken_for_every_type(monkeypatch: pytest.MonkeyPatch) -> None:
    # A valid payload of each type is decoded by msgspec alone, never by the reference path.
    payloads = [canonical.decode(env, max_size=MAX)["p"] for env in CORPUS]
    for payload, env in zip(payloads, CORPUS, strict=True):
        expected = open_envelope(env, ALL_TYPES, now=NOW, replay=None).message
        with monkeypatch.context() as mp:
            mp.setattr(canonical, "decode", None)
            assert fastdecode.decode_payload(type(expected), payload, max_size=MAX) == expected
    for msg in (make_task(), make_announce(), make_result(), make_manifest()):
        payload = canonical.encode(msg.to_wire())
        with monkeypatch.context() as mp:
            mp.setattr(canonical, "decode", None)
            assert fastdecode.decode_payload(type(msg), payload, max_size=MAX) == msg


@pytest.mark.timeout(60)
@_fast(150)
@given(any_message, st.data())
def test_fast_decode_agrees_on_mutated_payloads(msg: messages.Message, data: st.DataObject) -> None:
    wire = mutate_wire(data, msg.to_wire())
    try:
        payload = canonical.encode(wire)
    except SchemaError:
        return
    check_fast_decode(payload)
    check_fast_decode(msgpack_variants(payload, data))


def msgpack_variants(payload: bytes, data: st.DataObject) -> bytes:
    """Non-canonical spellings of the same value: ints where floats belong, float32, long forms."""
    obj = canonical.decode(payload, max_size=MAX)
    choice = data.draw(st.sampled_from(["float32", "intfloat", "unsorted"]))
    try:
        if choice == "float32":
            return msgpack.packb(obj, use_bin_type=True, use_single_float=True)
        if choice == "intfloat":
            return msgpack.packb(_ints_for_floats(obj), use_bin_type=True)
        return msgpack.packb(_reversed_maps(obj), use_bin_type=True)
    except (OverflowError, ValueError):  # a float64 beyond float32's range
        return payload


def _ints_for_floats(v: Any) -> Any:
    if type(v) is float and v.is_integer() and abs(v) < 2**53:
        return int(v)
    if isinstance(v, dict):
        return {k: _ints_for_floats(x) for k, x in v.items()}
    if isinstance(v, list):
        return [_ints_for_floats(x) for x in v]
    return v


def _reversed_maps(v: Any) -> Any:
    if isinstance(v, dict):
        return {k: _reversed_maps(v[k]) for k in reversed(list(v))}
    if isinstance(v, list):
        return [_reversed_maps(x) for x in v]
    return v


def test_corpus_is_valid() -> None:
    # Mutations start from envelopes that pass every check, so they probe each check in turn.
    for env in CORPUS:
        v = open_envelope(env, ALL_TYPES, now=NOW, replay=None)
        assert v.signer == PEER
        payload = canonical.decode(env, max_size=MAX)["p"]
        assert open_envelope(resign(env, payload), ALL_TYPES, now=NOW, replay=None).message == v.message


# --- slow: well over 10,000 cases ---------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(900)
@_fast(4000)
@given(st.binary(max_size=2000))
def test_random_bytes_slow(data: bytes) -> None:
    fuzz_one(data)


@pytest.mark.slow
@pytest.mark.timeout(900)
@_fast(4000)
@given(any_message, st.data())
def test_structurally_mutated_messages_slow(msg: messages.Message, data: st.DataObject) -> None:
    wire = mutate_wire(data, msg.to_wire())
    try:
        type(msg).from_wire(wire)
    except SchemaError:
        pass


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_seeded_mutations_slow() -> None:
    run_mutations(seed=2, n=20_000)
