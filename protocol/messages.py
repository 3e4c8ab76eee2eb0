"""The message catalogue: every message echo2 sends, with its limits, as schema-checked records.

The field specs, ``Record`` and ``Message`` live in :mod:`echo2.protocol.schema`; they are
re-exported here so ``messages.Int`` and friends keep working.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import ClassVar

from . import canonical, taskencode
from .batchmessages import BatchAck as BatchAck
from .batchmessages import BatchVerdict as BatchVerdict
from .batchmessages import ChannelOffer as ChannelOffer
from .batchmessages import ResultBatch as ResultBatch
from .hashing import digest
from .nodemessages import MAX_RECEIPT_TASKS as MAX_RECEIPT_TASKS
from .nodemessages import HoldsChallenge as HoldsChallenge
from .nodemessages import HoldsProof as HoldsProof
from .nodemessages import NodePause as NodePause
from .nodemessages import Receipt as Receipt
from .packedresult import PackedCompletion, PackedResult
from .schema import INT64_MAX as INT64_MAX
from .schema import INT64_MIN as INT64_MIN
from .schema import PEER_ID_MAX_LEN as PEER_ID_MAX_LEN
from .schema import Bool as Bool
from .schema import Bytes as Bytes
from .schema import Dict as Dict
from .schema import Float as Float
from .schema import Int as Int
from .schema import List as List
from .schema import Message as Message
from .schema import Nested as Nested
from .schema import Nullable as Nullable
from .schema import PeerId as PeerId
from .schema import Record as Record
from .schema import Spec as Spec
from .schema import Str as Str
from .schema import _fail

KiB = 1024
MiB = 1024 * KiB

HASH_SIZE = 32
TOKEN_ID_MAX = 2**31 - 1

MAX_PROMPTS = 256
MAX_PROMPT_TOKENS = 4096
MAX_GROUP_SIZE = 64
MAX_NEW_TOKENS = 8192
MAX_COMPLETIONS = MAX_PROMPTS * MAX_GROUP_SIZE
MAX_VERSIONS_LISTED = 16
MAX_TENSORS = 100_000
MAX_CHUNKS = 1_000_000
MAX_ARTIFACTS = 16
MAX_ARTIFACT_BYTES = 8 * MiB
MAX_PLAN_PEERS = 65_536
MAX_REQUEST_INDICES = 100_000
DTYPES = frozenset(
    {"float32", "float16", "bfloat16", "float64", "int64", "int32", "int16", "int8", "uint8", "bool"}
)


_HASH = Bytes(size=HASH_SIZE)
_U64 = Int(0, INT64_MAX)
_NONNEG_F = Float(0.0)
_ANY_F = Float()
_VERSION = Int(0, INT64_MAX)
_PEER = PeerId()


@dataclass(frozen=True)
class Announce(Message):
    TYPE: ClassVar[str] = "announce"
    MAX_SIZE: ClassVar[int] = 64 * KiB
    SPEC: ClassVar[dict[str, Spec]] = {
        "peer_id": _PEER,
        "software_version": Str(64),
        "accelerator": Str(128),
        "accelerator_count": _U64,
        "accelerator_memory_bytes": _U64,
        "cpu_model": Str(256),
        "cpu_cores": Int(1, INT64_MAX),
        "ram_bytes": _U64,
        "free_disk_bytes": _U64,
        "engine": Str(64),
        "engine_version": Str(64),
        "tokens_per_s": _NONNEG_F,
        "rollouts_per_s": _NONNEG_F,
        "upload_MBps": _NONNEG_F,
        "download_MBps": _NONNEG_F,
        "price_usd_per_hour": _NONNEG_F,
        "listen_addrs": List(Str(256), 16),
        "data_addr": Str(256),
        "reachable": Bool(),
        "versions_held": List(_VERSION, MAX_VERSIONS_LISTED),
        "max_upload_MBps": _NONNEG_F,
    }
    peer_id: str
    software_version: str
    accelerator: str
    accelerator_count: int
    accelerator_memory_bytes: int
    cpu_model: str
    cpu_cores: int
    ram_bytes: int
    free_disk_bytes: int
    engine: str
    engine_version: str
    tokens_per_s: float
    rollouts_per_s: float
    upload_MBps: float
    download_MBps: float
    price_usd_per_hour: float
    listen_addrs: list[str]
    data_addr: str
    reachable: bool
    versions_held: list[int]
    max_upload_MBps: float


@dataclass(frozen=True)
class Heartbeat(Message):
    TYPE: ClassVar[str] = "heartbeat"
    MAX_SIZE: ClassVar[int] = 4 * KiB
    SPEC: ClassVar[dict[str, Spec]] = {
        "peer_id": _PEER,
        "seq": _U64,
        "versions_held": List(_VERSION, MAX_VERSIONS_LISTED),
        "busy_tasks": _U64,
        "queue_free": _U64,
    }
    peer_id: str
    seq: int
    versions_held: list[int]
    busy_tasks: int
    queue_free: int


@dataclass(frozen=True)
class AdmissionRequest(Message):
    TYPE: ClassVar[str] = "admission_request"
    MAX_SIZE: ClassVar[int] = 72 * KiB
    SPEC: ClassVar[dict[str, Spec]] = {
        "peer_id": _PEER,
        "join_token": Str(512),
        "announce": Nested(Announce),
    }
    peer_id: str
    join_token: str
    announce: Announce


@dataclass(frozen=True)
class AdmissionDecision(Message):
    TYPE: ClassVar[str] = "admission_decision"
    MAX_SIZE: ClassVar[int] = 8 * KiB
    SPEC: ClassVar[dict[str, Spec]] = {
        "peer_id": _PEER,
        "admitted": Bool(),
        "reason": Str(512),
        "hub_data_addr": Str(256),
        "current_version": Int(-1, INT64_MAX),
        "staleness": _U64,
    }
    peer_id: str
    admitted: bool
    reason: str
    hub_data_addr: str
    current_version: int
    staleness: int


@dataclass(frozen=True)
class Task(Message):
    TYPE: ClassVar[str] = "task"
    # 256 prompts x 4096 ids x at most 5 bytes each is 5 MiB; the rest is small.
    MAX_SIZE: ClassVar[int] = 6 * MiB
    SPEC: ClassVar[dict[str, Spec]] = {
        "task_id": Str(64),
        "node_id": _PEER,
        "prompts": List(List(Int(0, TOKEN_ID_MAX), MAX_PROMPT_TOKENS), MAX_PROMPTS),
        "group_size": Int(1, MAX_GROUP_SIZE),
        "max_new_tokens": Int(1, MAX_NEW_TOKENS),
        "temperature": Float(0.0, 10.0),
        "top_p": Float(0.0, 1.0, lo_open=True),
        "seed": Int(0, INT64_MAX),
        "min_version": _VERSION,
        "max_version_lag": _U64,
        "deadline": _ANY_F,
    }
    task_id: str
    node_id: str
    prompts: list[list[int]]
    group_size: int
    max_new_tokens: int
    temperature: float
    top_p: float
    seed: int
    min_version: int
    max_version_lag: int
    deadline: float


MAX_BUNDLE_TASKS = 16


@dataclass(frozen=True)
class TaskBundle(Message):
    """Several tasks in one WORK reply (issue 20): a node whose Heartbeat says ``queue_free`` > 1
    may get up to that many of its waiting tasks at once, so it asks once per k tasks instead of
    once per task (a heartbeat cost the hub ~0.3 ms, as much as half a result). A node that says
    1 (every node before this message) gets a plain Task. Each task is exactly a Task's payload,
    so its hash is the same as if it had come alone."""

    TYPE: ClassVar[str] = "task_bundle"
    MAX_SIZE: ClassVar[int] = 6 * MiB  # as a Task's: the hub bundles only what fits
    SPEC: ClassVar[dict[str, Spec]] = {"tasks": List(Nested(Task), MAX_BUNDLE_TASKS, min_len=1)}
    tasks: list[Task]


@dataclass(frozen=True)
class Completion(Record):
    SPEC: ClassVar[dict[str, Spec]] = {
        "prompt_index": _U64,
        "token_ids": List(Int(0, TOKEN_ID_MAX), MAX_NEW_TOKENS),
        "logprobs": List(Float(-math.inf, 0.0), MAX_NEW_TOKENS),
        "finish_reason": Str(16, choices=("stop", "length")),
    }
    prompt_index: int
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str

    def _check_fields(self, path: str) -> None:
        if len(self.logprobs) != len(self.token_ids):
            raise _fail(
                path, f"{len(self.logprobs)} logprobs for {len(self.token_ids)} token_ids (must match)"
            )


@dataclass(frozen=True)
class Result(Message):
    TYPE: ClassVar[str] = "result"
    MAX_SIZE: ClassVar[int] = 64 * MiB
    SPEC: ClassVar[dict[str, Spec]] = {
        "task_id": Str(64),
        "task_hash": _HASH,
        "node_id": _PEER,
        "version": _VERSION,
        "completions": List(Nested(Completion), MAX_COMPLETIONS),
        "started_at": _ANY_F,
        "gen_seconds": _NONNEG_F,
        "tokens": _U64,
    }
    task_id: str
    task_hash: bytes
    node_id: str
    version: int
    completions: list[Completion]
    started_at: float
    gen_seconds: float
    tokens: int


@dataclass(frozen=True)
class TaskDecline(Message):
    TYPE: ClassVar[str] = "task_decline"
    MAX_SIZE: ClassVar[int] = 8 * KiB
    SPEC: ClassVar[dict[str, Spec]] = {
        "task_id": Str(64),
        "task_hash": _HASH,
        "node_id": _PEER,
        "reason_code": Str(64),
        "reason": Str(512),
    }
    task_id: str
    task_hash: bytes
    node_id: str
    reason_code: str
    reason: str


@dataclass(frozen=True)
class ManifestChunk(Record):
    SPEC: ClassVar[dict[str, Spec]] = {
        "index": _U64,
        "offset": _U64,
        "raw_size": Int(1, INT64_MAX),
        "raw_hash": _HASH,
        "encoding": Str(8, choices=("full", "delta")),
        "enc_size": Int(1, INT64_MAX),
        "enc_hash": _HASH,
        "parent_raw_hash": Nullable(_HASH),
    }
    index: int
    offset: int
    raw_size: int
    raw_hash: bytes
    encoding: str
    enc_size: int
    enc_hash: bytes
    parent_raw_hash: bytes | None

    def _check_fields(self, path: str) -> None:
        if (self.encoding == "delta") != (self.parent_raw_hash is not None):
            raise _fail(path, "parent_raw_hash is required iff encoding == 'delta'")


@dataclass(frozen=True)
class TensorEntry(Record):
    SPEC: ClassVar[dict[str, Spec]] = {
        "name": Str(256),
        "dtype": Str(16, choices=DTYPES),
        "shape": List(_U64, 8),
        "offset": _U64,
        "nbytes": _U64,
    }
    name: str
    dtype: str
    shape: list[int]
    offset: int
    nbytes: int


@dataclass(frozen=True)
class Manifest(Message):
    TYPE: ClassVar[str] = "manifest"
    MAX_SIZE: ClassVar[int] = 64 * MiB
    SPEC: ClassVar[dict[str, Spec]] = {
        "version": _VERSION,
        "parent": Nullable(_VERSION),
        "created": _ANY_F,
        "chunk_size": Int(1, INT64_MAX),
        "total_bytes": _U64,
        "tensors": List(Nested(TensorEntry), MAX_TENSORS),
        "chunks": List(Nested(ManifestChunk), MAX_CHUNKS),
        "model_config": Str(1 * MiB),
        "artifacts": Dict(Str(128), Bytes(max_len=MAX_ARTIFACT_BYTES), MAX_ARTIFACTS),
        "bf16_split": Bool(),
    }
    version: int
    parent: int | None
    created: float
    chunk_size: int
    total_bytes: int
    tensors: list[TensorEntry]
    chunks: list[ManifestChunk]
    model_config: str
    artifacts: dict[str, bytes]
    bf16_split: bool


MAX_STRIPES = 16


@dataclass(frozen=True)
class BroadcastPlan(Message):
    TYPE: ClassVar[str] = "broadcast_plan"
    MAX_SIZE: ClassVar[int] = 16 * MiB
    SPEC: ClassVar[dict[str, Spec]] = {
        "version": _VERSION,
        "stripes": Int(1, MAX_STRIPES),
        "parents": Dict(_PEER, List(_PEER, MAX_STRIPES, min_len=1), MAX_PLAN_PEERS),
        "children": Dict(_PEER, List(List(_PEER, MAX_PLAN_PEERS), MAX_STRIPES), MAX_PLAN_PEERS),
        "data_addrs": Dict(_PEER, Str(256), MAX_PLAN_PEERS),
        "created": _ANY_F,
        "punch_addrs": Dict(_PEER, Str(256), MAX_PLAN_PEERS),
    }
    # One tree per stripe (chunk i travels in stripe i % stripes); the hub is named by its peer ID.
    # data_addrs: reachable nodes (dialled); punch_addrs: the NAT-bound ends of edges joined by hole
    # punching, at the public ip:port the hub saw their listen port mapped to (node.punch).
    version: int
    stripes: int
    parents: dict[str, list[str]]
    children: dict[str, list[list[str]]]
    data_addrs: dict[str, str]
    created: float
    punch_addrs: dict[str, str] = dataclasses.field(default_factory=dict)


@dataclass(frozen=True)
class ChunkHave(Message):
    TYPE: ClassVar[str] = "chunk_have"
    MAX_SIZE: ClassVar[int] = 128 * KiB + 4 * KiB
    SPEC: ClassVar[dict[str, Spec]] = {
        "peer_id": _PEER,
        "version": _VERSION,
        "have": Bytes(max_len=(MAX_CHUNKS + 7) // 8),
    }
    peer_id: str
    version: int
    have: bytes


@dataclass(frozen=True)
class ChunkRequest(Message):
    TYPE: ClassVar[str] = "chunk_request"
    MAX_SIZE: ClassVar[int] = 1 * MiB
    SPEC: ClassVar[dict[str, Spec]] = {
        "version": _VERSION,
        "indices": List(Int(0, MAX_CHUNKS - 1), MAX_REQUEST_INDICES),
    }
    version: int
    indices: list[int]


@dataclass(frozen=True)
class HoldsVersion(Message):
    TYPE: ClassVar[str] = "holds_version"
    MAX_SIZE: ClassVar[int] = 4 * KiB
    SPEC: ClassVar[dict[str, Spec]] = {
        "peer_id": _PEER,
        "version": _VERSION,
        "seconds": _NONNEG_F,
    }
    peer_id: str
    version: int
    seconds: float


@dataclass(frozen=True)
class RelayReport(Message):
    """A node's report that a peer relayed it a chunk that does not match the hub-signed manifest.

    Signed by the reporter (``peer_id``). The hub checks what it can: that ``expected_hash`` is
    the manifest's ``enc_hash`` of chunk ``index`` of ``version`` and that ``got_hash`` differs
    from it. The bytes themselves are not signed by the relay, so a report is an accusation, not
    proof, however many peers make it: the hub asks the accused to serve it a chunk and bans it
    only if what it serves is corrupt.
    """

    TYPE: ClassVar[str] = "relay_report"
    MAX_SIZE: ClassVar[int] = 4 * KiB
    SPEC: ClassVar[dict[str, Spec]] = {
        "peer_id": _PEER,
        "accused": _PEER,
        "version": _VERSION,
        "index": Int(0, 1 << 24),
        "expected_hash": _HASH,
        "got_hash": _HASH,
    }
    peer_id: str
    accused: str
    version: int
    index: int
    expected_hash: bytes
    got_hash: bytes


@dataclass(frozen=True)
class ErrorReply(Message):
    TYPE: ClassVar[str] = "error"
    MAX_SIZE: ClassVar[int] = 8 * KiB
    SPEC: ClassVar[dict[str, Spec]] = {
        "code": Str(64),
        "message": Str(1024),
    }
    code: str
    message: str


@dataclass(frozen=True)
class ProbeReply(Message):
    """The hub's answer to a probe. Sent by the hub, read by ``echo2 node doctor`` and the node's link measurement.

    ``request_nonce`` is the nonce of the node's request envelope: it binds the reply to that
    request, so the node can accept it whatever its own clock says (and so measure the skew).
    """

    TYPE: ClassVar[str] = "probe_reply"
    MAX_SIZE: ClassVar[int] = 8 * 1024
    SPEC: ClassVar[dict[str, Spec]] = {
        "peer_id": _PEER,
        "request_nonce": Bytes(size=16),
        "hub_time": Float(0.0),
        "reachable": Bool(),
        "reason": Str(1024),
        "probe_data_addr": Str(256),
    }
    peer_id: str
    request_nonce: bytes
    hub_time: float
    reachable: bool
    reason: str
    probe_data_addr: str


MESSAGE_TYPES: dict[str, type[Message]] = {
    cls.TYPE: cls
    for cls in (
        Announce,
        Heartbeat,
        AdmissionRequest,
        AdmissionDecision,
        Task,
        TaskBundle,
        Result,
        PackedResult,
        TaskDecline,
        Manifest,
        BroadcastPlan,
        ChunkHave,
        ChunkRequest,
        HoldsVersion,
        HoldsChallenge,
        HoldsProof,
        RelayReport,
        ErrorReply,
        ProbeReply,
        Receipt,
        NodePause,
        ResultBatch,
        BatchAck,
        ChannelOffer,
    )
}
MESSAGE_TYPES_BY_DOMAIN: dict[str, type[Message]] = {c.DOMAIN: c for c in MESSAGE_TYPES.values()}
RECORD_TYPES: tuple[type[Record], ...] = (*MESSAGE_TYPES.values(), Completion, PackedCompletion, ManifestChunk, TensorEntry,
                                           BatchVerdict)


def _check_specs() -> None:
    # A spec/field mismatch is a programming error; fail at import, not on the first message.
    for cls in RECORD_TYPES:
        names = [f.name for f in dataclasses.fields(cls)]  # type: ignore[arg-type]
        if names != list(cls.SPEC):
            raise RuntimeError(f"{cls.__name__}: SPEC keys {list(cls.SPEC)} != fields {names}")
    # the direct writer must write every field of a Task, in canonical order
    if list(taskencode.KEYS) != sorted(Task.SPEC):
        raise RuntimeError(f"taskencode.KEYS {taskencode.KEYS} != Task's fields in canonical order {sorted(Task.SPEC)}")


_check_specs()


def task_hash(task: Task) -> bytes:
    """blake3 of the canonical encoding of ``task``: what a Result is bound to."""
    return digest(canonical.encode(task.to_wire()))


def task_payload(task: Task) -> bytes:
    """The canonical bytes of a Task the hub built itself: hashed for :func:`task_hash` and signed
    as they are by ``envelope.seal(..., payload=)``, so a task is encoded once, not three times.
    Its prompts are the one part drawn from data, so their counts are checked here as a node would
    (the rest are the hub's own typed values; the full from_wire round trip cost 26 us a task).

    Exactly ``canonical.encode(task.to_wire())``, written straight by :mod:`.taskencode` (2.3x
    cheaper) unless a value is of a type only the generic encoder takes or refuses."""
    prompts = task.prompts
    if len(prompts) > MAX_PROMPTS or any(len(p) > MAX_PROMPT_TOKENS for p in prompts):
        raise _fail("Task.prompts", f"more than {MAX_PROMPTS} prompts or {MAX_PROMPT_TOKENS} ids in one")
    fast = taskencode.pack(task)
    return fast if fast is not None else canonical.encode(task.to_wire())


def bundle_payload(payloads: list[bytes]) -> bytes:
    """A TaskBundle's canonical bytes from its tasks' (:func:`task_payload`): each nested task
    encodes as exactly its own payload, so a bundle costs no second encoding of its tasks."""
    n = len(payloads)
    if not 1 <= n <= MAX_BUNDLE_TASKS:
        raise _fail("TaskBundle.tasks", f"expected 1..{MAX_BUNDLE_TASKS} tasks, got {n}")
    head = bytes([0x90 | n]) if n < 16 else b"\xdc" + n.to_bytes(2, "big")  # msgpack's shortest array header
    return b"".join((b"\x81\xa5tasks", head, *payloads))
