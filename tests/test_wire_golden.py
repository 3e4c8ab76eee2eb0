"""Golden wire bytes: the canonical encoding of every message type, captured before the schema
library moved to msgspec. Signatures and task hashes depend on these bytes, so they must never change.

Each message holds the awkward cases: str/bin length-form boundaries, non-ASCII keys and strings,
ints at their form boundaries, -0.0 and extreme floats, None, nested records, maps keyed by peer ID.
"""

from __future__ import annotations

import hashlib
from typing import Any

from echo2.protocol import canonical, envelope
from echo2.protocol import messages as m
from echo2.protocol.identity import Identity

IDS = [Identity.from_seed(bytes([i + 1]) * 32) for i in range(3)]
P = [i.peer_id for i in IDS]
NOW = 1_700_000_000.25


def golden() -> dict[str, Any]:
    ann = m.Announce(
        P[1],
        "0.1.0",
        "NVIDIA H200 ☃",
        8,
        141 << 30,
        "x" * 200,
        16,
        2**40,
        2**63 - 1,
        "vllm",
        "0.6",
        1234.5,
        0.0,
        100.125,
        1e-300,
        1.5e300,
        ["/ip4/127.0.0.1/tcp/4001", "a" * 31, "b" * 32, "c" * 256],
        "h:1",
        True,
        [0, 1, 127, 128, 255, 256, 65536, 2**32],
        0.0,
    )
    task = m.Task(
        "t-" + "é" * 20,
        P[0],
        [[0, 1, 127, 128, 2**31 - 1], [], [65535, 65536]],
        4,
        8192,
        0.7,
        1.0,
        2**63 - 1,
        3,
        2,
        NOW,
    )
    comp = [m.Completion(0, [5, 6, 2], [-0.5, -1.25, -0.0], "stop"), m.Completion(2**40, [], [], "length")]
    return {
        "announce": ann,
        "heartbeat": m.Heartbeat(P[0], 5, [1, 2], 1, 3),
        "admission_request": m.AdmissionRequest(P[1], "tok" * 100, ann),
        "admission_decision": m.AdmissionDecision(P[0], False, "full", "127.0.0.1:9", -1, 2),
        "task": task,
        "result": m.Result("t-1", m.task_hash(task), P[0], 3, comp, NOW, 1.5, 3),
        "packed_result": m.PackedResult("t-1", m.task_hash(task), P[0], 3, [
            m.PackedCompletion(0, bytes.fromhex("05000000" "06000000" "ffffff7f"), bytes.fromhex("000000bf" "0000a0bf" "00000080"), "stop"),
            m.PackedCompletion(2**40, b"", b"", "length")], NOW, 1.5, 3),
        "task_decline": m.TaskDecline("t-1", b"\x01" * 32, P[0], "busy", "queue full"),
        "manifest": m.Manifest(
            4,
            None,
            NOW,
            4096,
            8192,
            [m.TensorEntry("w", "bfloat16", [64, 64], 0, 8192), m.TensorEntry("ß", "bool", [], 8192, 0)],
            [
                m.ManifestChunk(0, 0, 4096, b"\x01" * 32, "full", 100, b"\x02" * 32, None),
                m.ManifestChunk(1, 4096, 4096, b"\x03" * 32, "delta", 50, b"\x04" * 32, b"\x05" * 32),
            ],
            '{"hidden": 64}',
            {"z": b"", "tokenizer.json": b"{}", "é": b"\x00" * 300, "Z": b"x" * 70000},
            True,
        ),
        "broadcast_plan": m.BroadcastPlan(
            3,
            2,
            {P[1]: [P[0], P[2]], P[2]: [P[0], P[1]]},
            {P[0]: [[P[1]], [P[2]]], P[1]: [[], [P[2]]]},
            {P[0]: "a:1", P[1]: "b:2"},
            NOW,
            {P[2]: "10.0.0.3:4001"},
        ),
        "chunk_have": m.ChunkHave(P[0], 3, b"\xf0\x01"),
        "chunk_request": m.ChunkRequest(3, [0, 5, 9, 999_999]),
        "holds_version": m.HoldsVersion(P[0], 3, 1.0),
        "relay_report": m.RelayReport(P[0], P[1], 3, 1 << 24, b"\x03" * 32, b"\x04" * 32),
        "error": m.ErrorReply("schema", "bad ☃ \U0001f600"),
        "probe_reply": m.ProbeReply(P[0], b"\x02" * 16, NOW, True, "dialled back", "127.0.0.1:9"),
        "receipt": m.Receipt(P[2], P[0], ["t-1", "é" * 64], 2, 2**32, 65536, 100_000, NOW, 1, 127, 128, 2**63 - 1),
        "node_pause": m.NodePause(P[0], True, "hours", "outside the allowed hours 22-7 ☃", NOW),
        "holds_challenge": m.HoldsChallenge(P[1], 2**63 - 1, bytes(range(16)), 65535, 2**32, 1 << 20),
        "holds_proof": m.HoldsProof(P[1], 0, b"\xff" * 16, bytes(range(32))),
        "result_batch": m.ResultBatch(P[0], [b"", b"\x00" * 31, b"\xff" * 256, b"r" * 65536]),
        "batch_ack": m.BatchAck(P[0], [m.BatchVerdict(True, "ok", "", b"\x01" * 300),
                                       m.BatchVerdict(False, "duplicate", "task t-1 already answered ☃", b"")]),
        "channel_offer": m.ChannelOffer(P[2], P[0], "[::1]:65535", 32, 2**26 - 2**16),
        "task_bundle": m.TaskBundle([task, m.Task("t-2", P[1], [[1]], 1, 1, 0.0, 0.5, 0, 0, 0, -1.5)]),
    }


# sha256 of each message's canonical bytes (length in the comment), captured from the old schema code.
GOLDEN = {
    "announce": ("8f874c4e505ad56bd4df21fcd31b468527bd03d50408285ff84378aeb32f1370", 1037),
    "heartbeat": ("3a154b22b3f632576c83b9df7f0272b5aa7d9a75e22a8e2ad0383c1ab433d6a4", 109),
    "admission_request": ("671690285169afc88abb993d15ec10e90dc18360497b2b5b6f49991897d6e364", 1423),
    "admission_decision": ("d184a3086650e2a62f37fc08f655930146ba59af7aac7511ceb2af1ae227b9e2", 139),
    "task": ("ccca8ce23e8e582263b2a0e28c642ccd47876b77f638b028432e8ef56e420724", 273),
    "result": ("a7abb5eaa08922beb40a1bd1d8bb5c84d584116055727262341b77c92251bc1c", 340),
    "packed_result": ("8a6717c6eb653557385553b3e8aed5fbdbc50eb30bb0ebff7bb9da612e583726", 338),  # issue 20 item 3, captured at its introduction
    "task_decline": ("5f2c11c724ec344497483cdb66a48dd8a28a77306acc007983f805fa79cf470f", 154),
    "manifest": ("1d93345fecb116871a98ebad7d0aa6c6079fba7b0a5727c789be6a357785172a", 70909),
    "broadcast_plan": ("fba853a5affba6e37242b20138bc85042507479d8fafad69de39e67a1335c72a", 866),  # punch_addrs (issue 18)
    "chunk_have": ("e80afdcd30b64c5a20f53c5c50951740158ca06488484a2249d2db21eddadf67", 81),
    "chunk_request": ("9f51b17b96b7de871b47a9e43aa0c2b0152fab3cc06a70914c560f2b1bcbf171", 27),
    "holds_version": ("1c8095e2089b696a28b86e2dd11014a52685e60c956dff36a3c5735178ab3665", 89),
    "relay_report": ("cf5101a9e83f88b2e32171d43e0a25f2fdcda05edf7d9f4f1dbfa686ddc222a0", 236),
    "error": ("7029977ac982b98c10d7a0df5a3ba30b4557b7c706e8556ba9b9ee456df11731", 34),
    "probe_reply": ("0aab14b50bd3bd3da67735b49258838d0bc6bfbfd9536092f00a8e51349347d7", 172),
    "receipt": ("d496f208018f1ee086c5ef0fabf83add691e75e4ab2fc961c172cacafbf1ac0b", 425),  # issue 19, captured at its introduction
    "node_pause": ("72e56a84268e629aeaafcafc3c7d5af51be93fc0400abb730495afa33d385ea2", 151),  # added with it (issue 19)
    "holds_challenge": ("5be873ede04c662ba7be253f6b7440092caa752f6d33cb76d6dd85f10aa2bb2b", 141),  # A5, at its introduction
    "holds_proof": ("65bc8379327d961e9815801c2914a4388152b9f8f8b9ef2d798377d1479fbe0a", 137),  # A5, at its introduction
    "result_batch": ("d70059a40507d4a352804ab705840b0dae43932a5ec699ae04f834fc73021d06", 65907),  # issue 20 item 2, at its introduction
    "batch_ack": ("5aeb9f8d1b7397329a2d8fdc41b8b6f6e110ae80191f154b77dba252bf3c1f45", 486),  # issue 20 item 2, at its introduction
    "channel_offer": ("bdc68f2b8e2b49b85564e882d234a3ab668fea71c3493416f95253aece64de64", 173),  # issue 20 item 2, at its introduction
    "task_bundle": ("b24dc035dffb746965b98345a5fb00e1cd980df46ed3adeb2e7811e245736268", 485),  # issue 20, at its introduction
    "envelope_task": ("c9d96e50a4a2c08e4ce8dd9ccbbfb2a45915795bf0a3a9f3fa48f5872c652470", 444),
}
TASK_HASH = "626ea549864dad821f852ac36672287330583dfde51fab7c64cd3017492196e3"
TASK_BYTES = "8ba8646561646c696e65cb41d954fc40100000aa67726f75705f73697a6504ae6d61785f6e65775f746f6b656e73cd2000af6d61785f76657273696f6e5f6c616702ab6d696e5f76657273696f6e03a76e6f64655f6964d934313244334b6f6f574b3939566f56784e4537587a79427758457a573778684b37477076383572394633563366794b53554b504835a770726f6d707473939500017fcc80ce7fffffff9092cdffffce00010000a473656564cf7fffffffffffffffa77461736b5f6964d92a742dc3a9c3a9c3a9c3a9c3a9c3a9c3a9c3a9c3a9c3a9c3a9c3a9c3a9c3a9c3a9c3a9c3a9c3a9c3a9c3a9ab74656d7065726174757265cb3fe6666666666666a5746f705f70cb3ff0000000000000"


def _sha(b: bytes) -> tuple[str, int]:
    return hashlib.sha256(b).hexdigest(), len(b)


def test_every_type_is_covered() -> None:
    assert set(golden()) == set(m.MESSAGE_TYPES)


def test_canonical_bytes_unchanged() -> None:
    for name, msg in golden().items():
        assert msg.validate() == msg, name
        assert _sha(canonical.encode(msg.to_wire())) == GOLDEN[name], name
    assert canonical.encode(golden()["task"].to_wire()).hex() == TASK_BYTES
    # a bundle is its tasks' own payloads, as the hub builds it without encoding them again
    bundle = golden()["task_bundle"]
    assert m.bundle_payload([m.task_payload(t) for t in bundle.tasks]) == canonical.encode(bundle.to_wire())


def test_task_hash_unchanged() -> None:
    assert m.task_hash(golden()["task"]).hex() == TASK_HASH


def test_decoded_bytes_reencode_identically() -> None:
    for name, msg in golden().items():
        data = canonical.encode(msg.to_wire())
        back = type(msg).from_wire(canonical.decode(data, max_size=len(data)))
        assert back == msg, name
        assert canonical.encode(back.to_wire()) == data, name


def test_sealed_envelope_unchanged_and_opens() -> None:
    data = envelope.seal(IDS[0], golden()["task"], now=NOW, ttl_s=60.0, nonce=b"\x09" * 16)
    assert _sha(data) == GOLDEN["envelope_task"]
    v = envelope.open_envelope(data, m.Task, now=NOW, replay=None)
    assert v.message == golden()["task"] and v.signer == P[0]
