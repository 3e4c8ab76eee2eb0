"""The node's outbox of finished results (issue 20): what is waiting for the hub, and which of it
goes now, sans-IO.

The task loop puts each finished result here and asks the hub for its next task at once; the
delivery task (:mod:`.taskloop_delivery`) sends what is ready in one signed ResultBatch. This
module decides *what* and *when* (:func:`plan`), and keeps each waiting result on disk
(:func:`encode_entry` / :func:`decode_entry`, one file per result, written atomically and
fsynced), so a crash, a hub restart or a ``busy`` refusal loses nothing: a restarted node
delivers what it finds there while the task's deadline allows.

When to send. Whatever is ready goes at once, up to the hub's batch limits, unless the next
result is expected within ``linger_s`` of the oldest (from what the task loop is doing and its
measured generation time: :class:`WorkerState`), in which case it waits for that one. Never past a task's deadline less ``margin_s``,
and never once the node holds a newer policy version than a waiting result was made with (the
learner has moved on: each second brings the result nearer the staleness bound).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec

from echo2.protocol.channel import batch_prefix
from echo2.protocol.messages import Result
from echo2.protocol.packedresult import PackedResult

#: the file format of one waiting result
FORMAT = 1
#: the suffix of an outbox file (anything else in the directory is left alone)
SUFFIX = ".result"
#: results kept waiting at once by default: the hub lets a node hold few tasks (2 by default),
#: so more than this waiting means the hub is unreachable; the task loop then waits for room
MAX_ENTRIES = 64
#: bytes of results kept in memory at once (a single larger one is still taken)
MAX_BYTES = 512 * 1024 * 1024


@dataclass
class Entry:
    """One finished result waiting for the hub's verdict."""

    task_id: str
    deadline: float  # wall clock: the task's deadline, after which the hub no longer takes it
    version: int  # the policy version it was generated with
    ready_at: float  # wall clock: when it was finished
    size: int  # bytes of its encoded payload (an estimate of its envelope's size)
    result: PackedResult | Result
    failures: int = 0  # transient refusals and transport failures so far
    not_before: float = 0.0  # wall clock: retried no sooner (backoff after a transient failure)
    last_error: str = field(default="", compare=False)

    @property
    def name(self) -> str:
        """Its file name: the task id hashed (a hostile hub's task id never names a path)."""
        return hashlib.sha256(self.task_id.encode()).hexdigest()[:40] + SUFFIX


@dataclass(frozen=True)
class Plan:
    """What the delivery task does now: send ``send`` (in order, one batch); drop ``expired``
    (past their deadline); then wait until ``wake_at`` (or a new entry) when nothing is sent."""

    send: list[Entry]
    expired: list[Entry]
    wake_at: float | None


def plan(
    entries: Sequence[Entry],
    now: float,
    *,
    max_count: int,
    max_bytes: int,
    linger_s: float,
    next_at: float | None,
    held_version: int | None,
    recheck_at: float | None = None,
    margin_s: float = 5.0,
) -> Plan:
    """The decision of the delivery task over ``entries`` (oldest first).

    ``max_count`` / ``max_bytes``: the hub's batch limits (1 when there is no channel);
    ``next_at``: when the next result is expected (None: none is being made, or no measurement),
    an expectation that holds until ``recheck_at`` (None: until the next change);
    ``held_version``: the newest policy version this node holds.
    """
    # past its deadline, a result is still tried once (the hub may not have handed the task on
    # yet; if it has, its verdict says so and the node records it); one that failed is dropped
    expired = [e for e in entries if now >= e.deadline and e.failures > 0]
    live = [e for e in entries if now < e.deadline or e.failures == 0]
    ready = [e for e in live if e.not_before <= now]
    if not ready:
        later = [e.not_before for e in live]
        return Plan([], expired, min(later) if later else None)
    n = batch_prefix([e.size for e in ready], max_count=max(1, max_count), max_bytes=max_bytes)
    batch = ready[:n]
    full = n < len(ready) or n >= max_count
    if full or next_at is None or linger_s <= 0:
        return Plan(batch, expired, None)
    if held_version is not None and any(held_version > e.version for e in batch):
        return Plan(batch, expired, None)  # a newer version is out: no delay for a result made before it
    until = min(min(e.ready_at for e in batch) + linger_s, min(e.deadline for e in batch) - margin_s)
    if now < until and next_at <= until:  # the next result is expected in time to go with these
        return Plan([], expired, until if recheck_at is None else min(until, recheck_at))
    return Plan(batch, expired, None)


class WorkerState:
    """What the task loop is doing, to predict when its next result is finished.

    Generating: at its start plus the recent generation time. Asking the hub for work: a task may
    come at once (the hub had one for this node), and then a result a generation time later; but
    a hub that lets a node hold only so many tasks (``max_in_flight_per_node``, 2 by default)
    answers only once waiting results are delivered, so the prediction holds only for a grace of
    about two quick answers' time: past it, whatever waits goes (``recheck_at``)."""

    #: the grace given a work request, in seconds: at least (a loaded machine's scheduling) and at most
    GRACE_MIN_S = 0.01
    GRACE_MAX_S = 0.1

    def __init__(self, weight: float = 0.3) -> None:
        self.weight = weight
        self.gen_s: float | None = None  # mean generation time of a task
        self.answer_s: float | None = None  # mean time a work request took when the hub had a task
        self.state = "idle"
        self.since = 0.0

    def _mean(self, old: float | None, sample: float) -> float:
        return sample if old is None else old + self.weight * (sample - old)

    def polling(self, now: float) -> None:
        self.state, self.since = "polling", now

    def generating(self, now: float) -> None:
        if self.state == "polling" and now - self.since < 1.0:  # a long poll that waited is no sample
            self.answer_s = self._mean(self.answer_s, now - self.since)
        self.state, self.since = "generating", now

    def generated(self, now: float) -> None:
        if self.state == "generating":
            self.gen_s = self._mean(self.gen_s, now - self.since)
        self.state, self.since = "idle", now

    def idle(self, now: float) -> None:
        self.state, self.since = "idle", now

    def grace_s(self) -> float:
        if self.answer_s is None:
            return self.GRACE_MAX_S
        return min(self.GRACE_MAX_S, max(self.GRACE_MIN_S, 2 * self.answer_s))

    def predict(self, now: float) -> tuple[float | None, float | None]:
        """(when the next result is expected or None, when to look again or None)."""
        if self.gen_s is None:
            return None, None
        if self.state == "generating":
            return self.since + self.gen_s, None
        if self.state == "polling" and now < self.since + self.grace_s():
            end = self.since + self.grace_s()
            return end + self.gen_s, end
        return None, None


# --- the file of one entry ---------------------------------------------------------------------

_ENC = msgspec.msgpack.Encoder()


def encode_entry(e: Entry) -> bytes:
    kind = "packed" if isinstance(e.result, PackedResult) else "list"
    return _ENC.encode({"format": FORMAT, "task_id": e.task_id, "deadline": e.deadline, "version": e.version,
                        "ready_at": e.ready_at, "kind": kind, "result": e.result.to_wire()})


def decode_entry(data: bytes) -> Entry:
    """An entry read back from its file; ValueError (or a schema error) when it is not one."""
    d: Any = msgspec.msgpack.decode(data)
    if not isinstance(d, dict) or d.get("format") != FORMAT:
        raise ValueError("not an outbox entry of this format")
    cls: type[PackedResult] | type[Result] = PackedResult if d.get("kind") == "packed" else Result
    result = cls.from_wire(d["result"])
    if result.task_id != d["task_id"]:
        raise ValueError("outbox entry names two tasks")
    return Entry(task_id=str(d["task_id"]), deadline=float(d["deadline"]), version=int(d["version"]),
                 ready_at=float(d["ready_at"]), size=len(data), result=result)
