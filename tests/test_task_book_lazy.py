"""The task book encodes a task when first needed, not when it is issued (issue 20, loop lag: a
learner step's pump issues hundreds of tasks in one pass of the loop)."""

from __future__ import annotations

import pytest

from echo2.learner_hub import intake
from echo2.learner_hub.intake import TaskBook
from echo2.protocol.identity import Identity
from echo2.protocol.messages import Task, task_hash, task_payload

NODE = Identity.from_seed(b"\x0d" * 32).peer_id


def make(i: int) -> Task:
    return Task(task_id=f"t-{i}", node_id=NODE, prompts=[[1, 2, i]], group_size=4, max_new_tokens=16,
                temperature=1.0, top_p=1.0, seed=i, min_version=0, max_version_lag=1, deadline=1e9)


def test_issued_tasks_are_encoded_once_when_first_needed(monkeypatch: pytest.MonkeyPatch) -> None:
    encoded: list[str] = []

    def counting(task: Task) -> bytes:
        encoded.append(task.task_id)
        return task_payload(task)

    monkeypatch.setattr(intake, "task_payload", counting)
    book = TaskBook()
    tasks = [make(i) for i in range(100)]
    for t in tasks:
        book.open(t)
    assert encoded == []  # issuing encodes nothing
    # the node takes task 0: its bytes are made then, once, and its hash with them
    assert book.take_payload("t-0") == task_payload(tasks[0])
    e0 = book.get("t-0")
    assert e0 is not None and e0.task_hash == task_hash(tasks[0]) and encoded == ["t-0"]
    assert book.take_payload("t-0") is None  # taken once (the outbox re-encodes a second seal)
    # a result names task 1 before it was taken: its hash is made for the check
    e1 = book.get("t-1")
    assert e1 is not None and e1.task_hash == task_hash(tasks[1]) and encoded == ["t-0", "t-1"]
    assert book.take_payload("t-1") == task_payload(tasks[1]) and encoded == ["t-0", "t-1"]
    # a task closed before anyone needed it is never encoded
    book.close("t-2")
    assert "t-2" not in book and encoded == ["t-0", "t-1"]
    # a restored result's entry (no task) has no hash, as before
    book.buffered("restored", 1)
    restored = book.get("restored")
    assert restored is not None and restored.task_hash == b""
