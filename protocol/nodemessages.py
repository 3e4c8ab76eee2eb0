"""The volunteer's side of the wire (issues 15 and 19): pausing, receipts and statements of
account, and the proof that a node holds a version. Registered with the other message types in
:mod:`.messages` (which re-exports them); kept apart so that module stays one screenful of types.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from .schema import INT64_MAX, Bool, Bytes, Float, Int, List, Message, PeerId, Spec, Str, _fail

# the same bounds as messages.py (not imported: messages.py registers this module's types)
KiB = 1024
_HASH = Bytes(size=32)
_U64 = Int(0, INT64_MAX)
_NONNEG_F = Float(0.0)
_VERSION = Int(0, INT64_MAX)
_PEER = PeerId()

MAX_RECEIPT_TASKS = 16


@dataclass(frozen=True)
class HoldsChallenge(Message):
    """The hub's answer to ``HoldsVersion`` (A5): prove it. The node answers with a
    :class:`HoldsProof` of ``blake3(nonce || bytes [offset, offset + length) of raw chunk index)``
    (:mod:`echo2.protocol.holdsproof`); until then the claim earns no work."""

    TYPE: ClassVar[str] = "holds_challenge"
    MAX_SIZE: ClassVar[int] = 4 * KiB
    SPEC: ClassVar[dict[str, Spec]] = {
        "peer_id": _PEER,
        "version": _VERSION,
        "nonce": Bytes(size=16),
        "index": _U64,
        "offset": _U64,
        "length": Int(1, 1 << 20),
    }
    peer_id: str
    version: int
    nonce: bytes
    index: int
    offset: int
    length: int


@dataclass(frozen=True)
class HoldsProof(Message):
    TYPE: ClassVar[str] = "holds_proof"
    MAX_SIZE: ClassVar[int] = 4 * KiB
    SPEC: ClassVar[dict[str, Spec]] = {
        "peer_id": _PEER,
        "version": _VERSION,
        "nonce": Bytes(size=16),
        "digest": _HASH,
    }
    peer_id: str
    version: int
    nonce: bytes
    digest: bytes


@dataclass(frozen=True)
class NodePause(Message):
    """A node stops (``paused``) or resumes taking tasks because of its owner's computing
    preferences (hours, idle, CPU load, battery, transfer caps, a model that does not fit): the
    node is unavailable, not failing, so the hub neither punishes it nor bills it meanwhile.
    A paused node repeats it as its keepalive. ``resume_at``: when it expects to resume (unix
    seconds; 0 = not known)."""

    TYPE: ClassVar[str] = "node_pause"
    MAX_SIZE: ClassVar[int] = 4 * KiB
    SPEC: ClassVar[dict[str, Spec]] = {
        "peer_id": _PEER,
        "paused": Bool(),
        "reason_code": Str(64),
        "reason": Str(512),
        "resume_at": _NONNEG_F,
    }
    peer_id: str
    paused: bool
    reason_code: str
    reason: str
    resume_at: float


@dataclass(frozen=True)
class Receipt(Message):
    """The hub's signed proof that it accepted a batch of a node's results (issue 19).

    Sent in place of the plain "accepted" reply; the node keeps the envelope as received and can
    verify it offline (the hub's public key is embedded in ``hub_id``). Figures are the hub's own
    count (tokens counted in the result, not the node's claim). ``price_micro`` is the price per
    hour in force when the task was issued; ``account_*`` are the node's account at the hub right
    after this batch: ``account_cost_micro`` is the amount the hub owes the node so far (the
    ledger bills price x active time), so a node's credit is its latest receipt's figure and the
    increase between two receipts is what was earned in between.

    A *statement* is a receipt of no results (``results == 0``, no task ids): the hub's account of
    the node when it stops billing it (the node paused or left). The ledger bills active time, so
    time after the last accepted result is only covered by a statement; with it, the latest
    receipt's ``account_cost_micro`` equals the hub's ledger for the node.
    """

    TYPE: ClassVar[str] = "receipt"
    MAX_SIZE: ClassVar[int] = 4 * KiB
    SPEC: ClassVar[dict[str, Spec]] = {
        "hub_id": _PEER,
        "node_id": _PEER,
        "task_ids": List(Str(64), MAX_RECEIPT_TASKS),
        "results": _U64,
        "rollouts": _U64,
        "tokens": _U64,
        "price_micro": _U64,
        "accepted_at": _NONNEG_F,
        "account_results": _U64,
        "account_rollouts": _U64,
        "account_tokens": _U64,
        "account_cost_micro": _U64,
    }
    hub_id: str
    node_id: str
    task_ids: list[str]
    results: int
    rollouts: int
    tokens: int
    price_micro: int
    accepted_at: float
    account_results: int
    account_rollouts: int
    account_tokens: int
    account_cost_micro: int

    @property
    def is_statement(self) -> bool:
        return self.results == 0

    def _check_fields(self, path: str) -> None:
        if (self.results == 0) != (not self.task_ids) or (self.results == 0 and (self.rollouts or self.tokens)):
            raise _fail(path, "a receipt names its tasks and counts their results; a statement (0 results) names none")
