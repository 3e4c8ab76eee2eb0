"""The node's outbox of finished results (issue 20): what is waiting for the hub, and which of it
goes now, sans-IO.

The task loop puts each finished result here and asks the hub for its next task at once; the
delivery task (:mod:`.taskloop_delivery`) sends what is ready in one signed ResultBatch. This
module decides *what* and *when* (:func:`plan`), and keeps each waiting result on disk
(:func:`encode_entry` / :func:`decode_entry`, one file per result, written atomically and
fsynced), so a crash, a hub restart or a ``busy`` refusal loses nothing: a restarted node
delivers what it finds there while the task's deadline allows.

When to send. Whatever is ready goes at once, up to the hub's batch limits, unless the next
result is expected within ``linger_s`` of the oldest (from the measured interval between
results), in which case it waits for that one. Never past a task's deadline less ``margin_s``,
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
    margin_s: float = 5.0,
) -> Plan:
    """The decision of the delivery task over ``entries`` (oldest first).

    ``max_count`` / ``max_bytes``: the hub's batch limits (1 when there is no channel);
    ``next_at``: when the next result is expected (None: none is being made, or no measurement);
    ``held_version``: the newest policy version this node holds.
    """
    expired = [e for e in entries if now >= e.deadline]
    live = [e for e in entries if now < e.deadline]
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
    if now < until and next_at <= until:
        return Plan([], expired, until)  # the next result is expected in time to go with these
    return Plan(batch, expired, None)


class IntervalMeter:
    """The interval between finished results (an exponentially weighted mean), to predict the
    next one. A gap much longer than the mean (the node paused, the hub had no work) is not a
    sample: it would teach the outbox to wait for results that are not coming."""

    def __init__(self, weight: float = 0.3) -> None:
        self.weight = weight
        self.mean_s: float | None = None
        self.last_at: float | None = None

    def finished(self, at: float) -> None:
        if self.last_at is not None:
            gap = max(0.0, at - self.last_at)
            if self.mean_s is None:
                self.mean_s = gap
            elif gap <= 4 * self.mean_s + 1.0:
                self.mean_s += self.weight * (gap - self.mean_s)
        self.last_at = at

    def next_at(self) -> float | None:
        if self.mean_s is None or self.last_at is None:
            return None
        return self.last_at + self.mean_s


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
