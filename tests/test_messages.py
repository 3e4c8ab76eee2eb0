"""Message schemas: round trips for every type and every kind of schema refusal.

The hypothesis strategies here (``record_strategy``) are also used by the envelope and fuzz tests.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from echo2.protocol import canonical, messages, wire
from echo2.protocol.errors import SchemaError
from echo2.protocol.hashing import digest
from echo2.protocol.identity import Identity
from echo2.protocol.messages import (
    MESSAGE_TYPES,
    RECORD_TYPES,
    Announce,
    Completion,
    Manifest,
    ManifestChunk,
    Record,
    Result,
    Task,
    task_hash,
)

SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])

IDENTITIES = [Identity.from_seed(bytes([i + 1]) * 32) for i in range(4)]
PEERS = [i.peer_id for i in IDENTITIES]


# --- strategies derived from the field specs ---------------------------------------------------


def spec_strategy(spec: messages.Spec) -> st.SearchStrategy[Any]:
    """Valid values for one field spec (sizes kept small so tests stay fast)."""
    if isinstance(spec, messages.Int):
        return st.integers(spec.lo, spec.hi)
    if isinstance(spec, messages.Float):
        return st.floats(
            min_value=None if math.isinf(spec.lo) else spec.lo,
            max_value=None if math.isinf(spec.hi) else spec.hi,
            exclude_min=spec.lo_open,
            allow_nan=False,
            allow_infinity=False,
        )
    if isinstance(spec, messages.Bool):
        return st.booleans()
    if isinstance(spec, messages.Str):
        if spec.choices is not None:
            return st.sampled_from(sorted(spec.choices))
        return st.text(max_size=min(spec.max_len, 24))
    if isinstance(spec, messages.PeerId):
        return st.sampled_from(PEERS)
    if isinstance(spec, messages.Bytes):
        if spec.size is not None:
            return st.binary(min_size=spec.size, max_size=spec.size)
        return st.binary(max_size=min(spec.max_len or 64, 64))
    if isinstance(spec, messages.Nullable):
        return st.none() | spec_strategy(spec.inner)
    if isinstance(spec, messages.List):
        return st.lists(spec_strategy(spec.item), min_size=spec.min_len, max_size=min(spec.max_len, 4))
    if isinstance(spec, messages.Dict):
        return st.dictionaries(
            spec_strategy(spec.key), spec_strategy(spec.value), max_size=min(spec.max_len, 4)
        )
    if isinstance(spec, messages.Nested):
        return record_strategy(spec.cls)
    raise AssertionError(f"no strategy for {spec!r}")


def _fix_cross_fields(cls: type[Record], kw: dict[str, Any]) -> dict[str, Any]:
    if cls is Completion:
        n = min(len(kw["token_ids"]), len(kw["logprobs"]))
        kw["token_ids"], kw["logprobs"] = kw["token_ids"][:n], kw["logprobs"][:n]
    if cls is messages.PackedCompletion:  # whole int32 ids (non-negative) and float32 log-probs in (-inf, 0]
        import numpy as np

        ids = np.frombuffer(kw["token_ids"][: len(kw["token_ids"]) // 4 * 4], dtype="<i4")
        kw["token_ids"] = np.abs(ids.astype(np.int64)).clip(0, 2**31 - 1).astype("<i4").tobytes()
        kw["logprobs"] = (-np.arange(len(ids), dtype="<f4") / 3).astype("<f4").tobytes()
    if cls is ManifestChunk:
        if kw["encoding"] == "delta" and kw["parent_raw_hash"] is None:
            kw["parent_raw_hash"] = b"\x07" * 32
        if kw["encoding"] == "full":
            kw["parent_raw_hash"] = None
    if cls is messages.Receipt:
        if not kw["task_ids"] or kw["results"] == 0:  # a statement: no tasks, no results
            kw["task_ids"], kw["results"], kw["rollouts"], kw["tokens"] = [], 0, 0, 0
    return kw


def record_strategy(cls: type[Record]) -> st.SearchStrategy[Any]:
    fields = st.fixed_dictionaries({name: spec_strategy(s) for name, s in cls.SPEC.items()})
    return fields.map(lambda kw: cls(**_fix_cross_fields(cls, kw)))


any_message = st.sampled_from(sorted(MESSAGE_TYPES)).flatmap(lambda t: record_strategy(MESSAGE_TYPES[t]))


# --- examples used by targeted tests -----------------------------------------------------------


def make_task(**over: Any) -> Task:
    kw: dict[str, Any] = dict(
        task_id="t-1",
        node_id=PEERS[0],
        prompts=[[1, 2, 3], [4, 5]],
        group_size=4,
        max_new_tokens=32,
        temperature=1.0,
        top_p=0.95,
        seed=7,
        min_version=3,
        max_version_lag=2,
        deadline=1_700_000_000.5,
    )
    kw.update(over)
    return Task(**kw)


def make_announce(**over: Any) -> Announce:
    kw: dict[str, Any] = dict(
        peer_id=PEERS[1],
        software_version="0.1.0",
        accelerator="",
        accelerator_count=0,
        accelerator_memory_bytes=0,
        cpu_model="test cpu",
        cpu_cores=2,
        ram_bytes=8 << 30,
        free_disk_bytes=50 << 30,
        engine="transformers",
        engine_version="5.24",
        tokens_per_s=120.5,
        rollouts_per_s=0.8,
        upload_MBps=10.0,
        download_MBps=50.0,
        price_usd_per_hour=0.0,
        listen_addrs=["/ip4/127.0.0.1/tcp/4001"],
        data_addr="127.0.0.1:5001",
        reachable=True,
        versions_held=[1, 2],
        max_upload_MBps=0.0,
    )
    kw.update(over)
    return Announce(**kw)


def make_result(**over: Any) -> Result:
    kw: dict[str, Any] = dict(
        task_id="t-1",
        task_hash=task_hash(make_task()),
        node_id=PEERS[0],
        version=3,
        completions=[Completion(0, [5, 6, 2], [-0.5, -1.25, -0.0], "stop")],
        started_at=1_700_000_000.0,
        gen_seconds=1.5,
        tokens=3,
    )
    kw.update(over)
    return Result(**kw)


def make_manifest(**over: Any) -> Manifest:
    kw: dict[str, Any] = dict(
        version=4,
        parent=3,
        created=1_700_000_000.0,
        chunk_size=4096,
        total_bytes=8192,
        tensors=[messages.TensorEntry("w", "bfloat16", [64, 64], 0, 8192)],
        chunks=[
            ManifestChunk(0, 0, 4096, b"\x01" * 32, "full", 100, b"\x02" * 32, None),
            ManifestChunk(1, 4096, 4096, b"\x03" * 32, "delta", 50, b"\x04" * 32, b"\x05" * 32),
        ],
        model_config='{"hidden": 64}',
        artifacts={"tokenizer.json": b"{}"},
        bf16_split=False,
    )
    kw.update(over)
    return Manifest(**kw)


def refused(cls: type[Record], wire: Any, match: str) -> None:
    with pytest.raises(SchemaError, match=match):
        cls.from_wire(wire)


# --- registry ----------------------------------------------------------------------------------


def test_registry() -> None:
    expected = {
        "announce", "heartbeat", "admission_request", "admission_decision", "task", "result", "packed_result",
        "task_decline", "manifest", "broadcast_plan", "chunk_have", "chunk_request",
        "holds_version", "holds_challenge", "holds_proof", "relay_report", "error", "probe_reply", "receipt", "node_pause",
        "result_batch", "batch_ack", "channel_offer", "task_bundle",
    }  # fmt: skip
    assert set(MESSAGE_TYPES) == expected
    domains = set()
    for t, cls in MESSAGE_TYPES.items():
        assert cls.TYPE == t
        assert cls.DOMAIN == f"echo2/{t}/1.0.0"
        assert not hasattr(cls, "PROTOCOL_ID")  # stream IDs live in wire.py only
        assert cls.MAX_SIZE > 0
        domains.add(cls.DOMAIN)
        assert dataclasses.is_dataclass(cls)
    assert len(domains) == len(MESSAGE_TYPES)
    assert Manifest.MAX_SIZE == 64 * 1024 * 1024


def test_frozen() -> None:
    t = make_task()
    with pytest.raises(dataclasses.FrozenInstanceError):
        t.seed = 8  # type: ignore[misc]


# --- round trips -------------------------------------------------------------------------------


@pytest.mark.parametrize("cls", RECORD_TYPES, ids=lambda c: c.__name__)
@SETTINGS
@given(data=st.data())
def test_round_trip_every_type(cls: type[Record], data: st.DataObject) -> None:
    msg = data.draw(record_strategy(cls))
    wire = msg.to_wire()
    encoded = canonical.encode(wire)
    back = cls.from_wire(canonical.decode(encoded, max_size=len(encoded)))
    assert back == msg
    assert canonical.encode(back.to_wire()) == encoded
    assert msg.validate() == msg


def test_examples_round_trip() -> None:
    for msg in (make_task(), make_announce(), make_result(), make_manifest()):
        assert type(msg).from_wire(canonical.decode(canonical.encode(msg.to_wire()), max_size=10**6)) == msg
    req = messages.AdmissionRequest(PEERS[1], "", make_announce())
    wire = req.to_wire()
    assert wire["announce"]["peer_id"] == PEERS[1]  # nested as a plain map
    assert messages.AdmissionRequest.from_wire(wire) == req


# --- task hash ---------------------------------------------------------------------------------


def test_task_hash() -> None:
    t = make_task()
    h = task_hash(t)
    assert len(h) == 32
    assert h == digest(canonical.encode(t.to_wire()))
    assert task_hash(Task.from_wire(t.to_wire())) == h
    # An int given for a float field is normalized: one message, one hash.
    assert task_hash(make_task(temperature=1)) == h
    for name, value in [("seed", 8), ("prompts", [[1, 2, 3], [4, 6]]), ("top_p", 0.9), ("node_id", PEERS[2])]:
        assert task_hash(dataclasses.replace(t, **{name: value})) != h, name


# --- refusals ----------------------------------------------------------------------------------


def test_not_a_map() -> None:
    bad: Any
    for bad in (None, [], "task", 3, b"x"):
        refused(Task, bad, "expected map")


def test_unknown_and_missing_fields() -> None:
    w = make_task().to_wire()
    refused(Task, {**w, "extra": 1}, r"unknown field\(s\) \['extra'\]")
    del w["seed"]
    refused(Task, w, r"missing field\(s\) \['seed'\]")
    refused(Task, {**w, "extra": 1}, "unknown field")


@pytest.mark.parametrize(
    "field,value,match",
    [
        ("seed", "7", "Task.seed: expected int, got str"),
        ("seed", True, "Task.seed: expected int, got bool"),
        ("seed", 7.0, "expected int, got float"),
        ("seed", -1, "out of range"),
        ("seed", 2**63, "out of range"),
        ("temperature", 1, "Task.temperature: expected float, got int"),
        ("temperature", math.nan, "non-finite"),
        ("temperature", math.inf, "non-finite"),
        ("temperature", -math.inf, "non-finite"),
        ("temperature", 10.000001, "out of range"),
        ("temperature", -0.1, "out of range"),
        ("top_p", 0.0, r"out of range \(0"),
        ("top_p", 1.01, "out of range"),
        ("group_size", 0, "out of range"),
        ("group_size", 65, "out of range"),
        ("max_new_tokens", 8193, "out of range"),
        ("task_id", "x" * 65, "Task.task_id: string of 65 chars exceeds 64"),
        ("task_id", b"t-1", "expected str, got bytes"),
        ("prompts", [[1]] * 257, "Task.prompts: list of 257 items exceeds 256"),
        ("prompts", [[1] * 4097], r"Task.prompts\[0\]: list of 4097 items exceeds 4096"),
        ("prompts", [[1], [2, 2**31]], r"Task.prompts\[1\]\[1\]: 2147483648 out of range"),
        ("prompts", [[1], [2, -1]], r"Task.prompts\[1\]\[1\]"),
        ("prompts", [[1], (2, 3)], r"Task.prompts\[1\]: expected list"),
        ("prompts", [[1, None]], r"Task.prompts\[0\]\[1\]: expected int"),
        ("node_id", "not-a-peer", "Task.node_id: invalid peer ID"),
        ("node_id", "1" * 65, "exceeds 64"),
        ("node_id", "QmYyQSo1c1Ym7orWxLYvCrM2EmxFTANf8wXmmE7DWjhx5N", "does not embed an Ed25519"),
        ("node_id", "0OIl", "invalid peer ID"),
        ("deadline", math.nan, "non-finite"),
    ],
)
def test_task_field_refusals(field: str, value: Any, match: str) -> None:
    refused(Task, {**make_task().to_wire(), field: value}, match)


def test_limits_are_inclusive() -> None:
    w = make_task().to_wire()
    for field, value in [
        ("temperature", 10.0),
        ("temperature", 0.0),
        ("top_p", 1.0),
        ("group_size", 64),
        ("prompts", [[0, 2**31 - 1]]),
        ("task_id", "x" * 64),
    ]:
        Task.from_wire({**w, field: value})


@pytest.mark.parametrize(
    "field,value,match",
    [
        ("price_usd_per_hour", -0.01, "Announce.price_usd_per_hour: -0.01 out of range"),
        ("tokens_per_s", math.inf, "non-finite"),
        ("cpu_cores", 0, "out of range"),
        ("listen_addrs", ["/ip4/1.2.3.4/tcp/1"] * 17, "list of 17 items exceeds 16"),
        ("listen_addrs", ["x" * 257], r"Announce.listen_addrs\[0\]: string of 257"),
        ("versions_held", list(range(17)), "exceeds 16"),
        ("reachable", 1, "expected bool, got int"),
        ("cpu_model", "c" * 257, "exceeds 256"),
    ],
)
def test_announce_refusals(field: str, value: Any, match: str) -> None:
    refused(Announce, {**make_announce().to_wire(), field: value}, match)


def test_nested_refusals_name_the_path() -> None:
    req = messages.AdmissionRequest(PEERS[1], "tok", make_announce()).to_wire()
    req["announce"]["price_usd_per_hour"] = -1.0
    refused(messages.AdmissionRequest, req, r"AdmissionRequest.announce.price_usd_per_hour")
    req["announce"] = "nope"
    refused(messages.AdmissionRequest, req, r"AdmissionRequest.announce: expected map")


def test_result_refusals() -> None:
    w = make_result().to_wire()
    c = w["completions"][0]
    refused(Result, {**w, "task_hash": b"\x00" * 31}, "Result.task_hash: expected exactly 32 bytes, got 31")
    refused(Result, {**w, "task_hash": "00" * 32}, "expected bytes, got str")
    refused(Result, {**w, "gen_seconds": -1.0}, "out of range")
    refused(Result, {**w, "completions": [{**c, "logprobs": [-0.5, 0.25, -1.0]}]}, r"logprobs\[1\]: 0.25")
    refused(Result, {**w, "completions": [{**c, "logprobs": [-0.5, -math.inf, -1.0]}]}, "non-finite")
    refused(Result, {**w, "completions": [{**c, "logprobs": [-0.5]}]}, "1 logprobs for 3 token_ids")
    refused(Result, {**w, "completions": [{**c, "finish_reason": "eos"}]}, "is not one of")
    refused(Result, {**w, "completions": [{**c, "token_ids": [1] * 8193}]}, "exceeds 8192")
    refused(Result, {**w, "completions": [{**c, "extra": 1}]}, r"Result.completions\[0\]: unknown field")


def test_manifest_refusals() -> None:
    w = make_manifest().to_wire()
    full, delta = w["chunks"]
    refused(Manifest, {**w, "chunks": [{**full, "parent_raw_hash": b"\x01" * 32}]}, "required iff")
    refused(Manifest, {**w, "chunks": [{**delta, "parent_raw_hash": None}]}, "required iff")
    refused(Manifest, {**w, "chunks": [{**full, "encoding": "zstd"}]}, "is not one of")
    refused(Manifest, {**w, "chunks": [{**full, "raw_size": 0}]}, "out of range")
    refused(Manifest, {**w, "tensors": [{**w["tensors"][0], "dtype": "float8"}]}, "is not one of")
    refused(Manifest, {**w, "tensors": [{**w["tensors"][0], "shape": [1] * 9}]}, "exceeds 8")
    refused(Manifest, {**w, "artifacts": {f"a{i}": b"" for i in range(17)}}, "17 entries exceeds 16")
    refused(Manifest, {**w, "artifacts": {"x" * 129: b""}}, "Manifest.artifacts key: string of 129")
    refused(Manifest, {**w, "artifacts": {"big": b"\x00" * (8 * 1024 * 1024 + 1)}}, "exceeds 8388608")
    refused(Manifest, {**w, "artifacts": [("a", b"")]}, "expected map")
    refused(Manifest, {**w, "parent": -1}, "out of range")
    assert Manifest.from_wire({**w, "parent": None}).parent is None


def test_other_refusals() -> None:
    d = messages.AdmissionDecision(PEERS[0], True, "", "127.0.0.1:1", -1, 0)
    assert messages.AdmissionDecision.from_wire(d.to_wire()) == d
    refused(messages.AdmissionDecision, {**d.to_wire(), "current_version": -2}, "out of range")
    plan = messages.BroadcastPlan(1, 1, {PEERS[1]: [PEERS[0]]}, {PEERS[0]: [[PEERS[1]]]}, {PEERS[0]: "h:1"}, 1.0)
    pw = plan.to_wire()
    refused(messages.BroadcastPlan, {**pw, "parents": {"bad": [PEERS[0]]}}, "BroadcastPlan.parents key")
    refused(messages.BroadcastPlan, {**pw, "children": {PEERS[0]: [["bad"]]}}, r"children\['12D3KooW")
    refused(messages.BroadcastPlan, {**pw, "stripes": 17}, "BroadcastPlan.stripes")
    have = messages.ChunkHave(PEERS[0], 1, b"\xff")
    refused(messages.ChunkHave, {**have.to_wire(), "have": b"\x00" * 125_001}, "exceeds 125000")
    refused(messages.ChunkRequest, {"version": 1, "indices": [0] * 100_001}, "exceeds 100000")
    refused(messages.ErrorReply, {"code": "x" * 65, "message": ""}, "exceeds 64")
    refused(messages.ErrorReply, {"code": "x", "message": "m" * 1025}, "exceeds 1024")
    refused(messages.Heartbeat, {"peer_id": PEERS[0], "seq": -1, "versions_held": [], "busy_tasks": 0,
                                 "queue_free": 0}, "Heartbeat.seq")  # fmt: skip


def test_validate_refuses_bad_local_messages() -> None:
    with pytest.raises(SchemaError, match="Task.temperature"):
        make_task(temperature=math.nan).validate()
    with pytest.raises(SchemaError, match="Announce.price_usd_per_hour"):
        make_announce(price_usd_per_hour=-3.0).validate()
    with pytest.raises(SchemaError, match="Task.node_id"):
        make_task(node_id="me").validate()


def test_stream_protocol_ids_defined_once() -> None:
    ids = [wire.ADMISSION, wire.WORK, wire.RESULT, wire.DECLINE, wire.HOLDS, wire.REPORT, wire.PROBE]
    assert len(set(ids)) == len(ids)
    assert all(p.startswith("/echo2/") and p.endswith("/1.0.0") for p in ids)
