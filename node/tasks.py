"""Deciding whether to run a task (pure): the hub's signature, expiry, addressee, version bound.

Every refusal is a distinct error with a code the hub understands (it travels back in a
TaskDecline): a forged task fails the signature or signer check, an expired one its expiry or
deadline, one for a version the node does not hold ``version_not_held``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from echo2.protocol import envelope
from echo2.protocol.errors import Expired, MeaningError
from echo2.protocol.messages import ErrorReply, Task, TaskBundle


class NotForMe(MeaningError):
    """Task is assigned to another node."""

    code = "not_mine"


class VersionNotHeld(MeaningError):
    """Task needs a policy version this node does not hold."""

    code = "version_not_held"


class TaskRefused(MeaningError):
    """An authentic task this node will not run (declined to the hub with the inner code)."""

    code = "task_refused"

    def __init__(self, task: Task, reason: MeaningError | Expired) -> None:
        super().__init__(reason.message)
        self.task = task
        self.reason = reason
        self.code = reason.code


@dataclass(frozen=True)
class Accepted:
    task: Task | None  # None when the hub answered "no work"
    reply: ErrorReply | None = None
    more: tuple[Task, ...] = ()  # the rest of a TaskBundle, checked, to run after ``task``
    refused: tuple[TaskRefused, ...] = ()  # tasks of a TaskBundle this node will not run (to decline)


def open_task(
    data: bytes,
    *,
    hub_peer: str,
    me: str,
    held_version: int | None,
    replay: envelope.ReplayGuard | None,
    now: float | None = None,
) -> Accepted:
    """Verify a work reply from the hub and check the task; raise the refusal's error.

    A :class:`TaskRefused` carries the authentic task so the node can decline it to the hub;
    any other error means the reply itself is not authentic and must not be answered."""
    now = time.time() if now is None else now
    v = envelope.open_envelope(
        data, (Task, TaskBundle, ErrorReply), now=now, replay=replay, allowed=lambda signer, _t: signer == hub_peer
    )
    if isinstance(v.message, ErrorReply):
        return Accepted(None, v.message)
    if isinstance(v.message, TaskBundle):  # one signature over several tasks, each checked alone
        ok: list[Task] = []
        refused: list[TaskRefused] = []
        for task in v.message.tasks:
            try:
                ok.append(check_task(task, me=me, held_version=held_version, now=now))
            except (MeaningError, Expired) as exc:
                refused.append(TaskRefused(task, exc))
        return Accepted(ok[0] if ok else None, None, tuple(ok[1:]), tuple(refused))
    try:
        return Accepted(check_task(v.message, me=me, held_version=held_version, now=now))
    except MeaningError as exc:
        raise TaskRefused(v.message, exc) from exc
    except Expired as exc:
        raise TaskRefused(v.message, exc) from exc


def check_task(task: Task, *, me: str, held_version: int | None, now: float) -> Task:
    if task.node_id != me:
        raise NotForMe(f"task {task.task_id} is assigned to {task.node_id}, not to this node")
    if task.deadline < now:
        raise Expired(f"task {task.task_id} deadline passed {now - task.deadline:.1f}s ago")
    if held_version is None or held_version < task.min_version:
        have = -1 if held_version is None else held_version
        raise VersionNotHeld(f"task {task.task_id} needs policy version >= {task.min_version}; this node holds {have}")
    return task
