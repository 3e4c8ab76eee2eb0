"""Intake (pure): verdicts on results, and a task book that forgets every closed task."""

from __future__ import annotations

import pytest

from echo2.learner_hub.dispatch import DispatchConfig, Dispatcher, PromptGroup
from echo2.learner_hub.intake import Accept, Intake, Punish, Refuse, TaskParams
from echo2.protocol.errors import MeaningError, SignerNotAllowed
from echo2.protocol.messages import Completion, Result, Task, task_hash

VOCAB = 100
STOP = 2


def make_intake(staleness: int = 1) -> Intake:
    d = Dispatcher(DispatchConfig(staleness=staleness, target_task_s=1.0), task_id_prefix="t")
    d.add_node("A", rate=8.0)
    d.add_node("B", rate=8.0)
    return Intake(
        d, TaskParams(group_size=2, max_new_tokens=4, temperature=1.0, top_p=1.0),
        vocab_size=VOCAB, stop_ids=[STOP], decode=lambda ids: ",".join(map(str, ids)),
    )


def submit(intake: Intake, n: int) -> None:
    # the env item is what a correct completion decodes to
    intake.dispatcher.submit(PromptGroup(f"p{i}", (1, i + 3), 2, item=f"{i + 3}") for i in range(n))


def answer(task: Task, *, version: int = 0, node: str | None = None, tokens: list[int] | None = None) -> Result:
    comps = []
    for i, prompt in enumerate(task.prompts):
        for _ in range(task.group_size):
            ids = tokens if tokens is not None else [prompt[-1], STOP]
            comps.append(Completion(prompt_index=i, token_ids=ids, logprobs=[-0.5] * len(ids), finish_reason="stop"))
    return Result(task_id=task.task_id, task_hash=task_hash(task), node_id=node or task.node_id, version=version,
                  completions=comps, started_at=0.0, gen_seconds=0.1, tokens=sum(len(c.token_ids) for c in comps))


def issue(intake: Intake, now: float = 0.0) -> list[Task]:
    return intake.issue(now, 0, ["A", "B"], lambda: 7)


def test_honest_result_gives_rows_with_rewards_and_a_duplicate_is_refused() -> None:
    intake = make_intake()
    submit(intake, 2)
    tasks = issue(intake)
    assert tasks and len(intake.book) == len(tasks)
    t = tasks[0]
    v = intake.judge(t.node_id, answer(t), 1.0, 0)
    assert isinstance(v, Accept)
    assert [len(g.samples) for g in v.rows] == [2] * len(t.prompts)
    # the stop token is not part of the text the reward functions score (the hub scores it later)
    assert all(s.node_id == t.node_id and s.version == 0 for g in v.rows for s in g.samples)
    items = [g.item for g in v.task.groups]
    assert v.texts == [[item] * 2 for item in items]
    dup = intake.judge(t.node_id, answer(t), 1.0, 0)
    assert isinstance(dup, Refuse) and dup.code == "duplicate"
    with pytest.raises(MeaningError, match="duplicate"):
        raise dup.error


def test_forgeries_are_punished() -> None:
    intake = make_intake()
    submit(intake, 2)
    t = issue(intake)[0]
    other = "B" if t.node_id == "A" else "A"
    v = intake.judge(other, answer(t), 1.0, 0)  # signed by one node, naming another
    assert isinstance(v, Punish) and isinstance(v.error, SignerNotAllowed)
    v = intake.judge(other, answer(t, node=other), 1.0, 0)  # another node's task: refused, task stays
    assert isinstance(v, Refuse) and v.code == "wrong_node"
    bad_hash = Result(**{**answer(t).__dict__, "task_hash": bytes(32)})
    v = intake.judge(t.node_id, bad_hash, 1.0, 0)
    assert isinstance(v, Punish) and "task hash" in v.error.message
    v = intake.judge(t.node_id, answer(t, tokens=[VOCAB + 1]), 1.0, 0)
    assert isinstance(v, Punish) and "vocabulary" in v.error.message
    v = intake.judge(t.node_id, answer(t, tokens=[5] * 5), 1.0, 0)
    assert isinstance(v, Punish) and "max_new_tokens" in v.error.message
    # none of these closed the task: the honest answer is still accepted
    assert isinstance(intake.judge(t.node_id, answer(t), 1.0, 0), Accept)


def test_stale_result_refused_and_its_entry_pruned() -> None:
    intake = make_intake(staleness=1)
    submit(intake, 2)
    t = issue(intake)[0]
    v = intake.judge(t.node_id, answer(t, version=0), 1.0, 2)
    assert isinstance(v, Refuse) and v.code == "stale"
    assert t.task_id not in intake.book


def test_book_is_bounded_by_tasks_in_flight_and_in_the_buffer() -> None:
    intake = make_intake()
    for rnd in range(50):
        submit(intake, 4)
        tasks = issue(intake, now=float(rnd))
        assert len(intake.book) == len(intake.dispatcher.in_flight) == len(tasks)
        accepted, rest = tasks[0], tasks[1:]
        assert isinstance(intake.judge(accepted.node_id, answer(accepted), float(rnd), 0), Accept)
        intake.book.buffered(accepted.task_id, len(accepted.prompts))
        for t in rest[:1]:
            assert intake.decline(t.task_id, t.node_id, "busy")
        for t in rest[1:]:
            intake.node_left(t.node_id)
            intake.dispatcher.add_node(t.node_id, rate=8.0)
        expired = intake.expire(float(rnd) + 10_000.0)
        assert not intake.dispatcher.in_flight and all(tid not in intake.book for tid, _ in expired)
        assert len(intake.book) == 1  # only the accepted task, waiting for its groups to train
        done = [intake.book.group_gone(accepted.task_id) for _ in accepted.prompts]
        assert done[-1] and not any(done[:-1])
        assert len(intake.book) == 0
        intake.dispatcher.queue.clear()


def test_a_result_for_another_nodes_closed_task_is_still_a_forgery() -> None:
    # The book forgets a task's hash when it closes; the binding is still judged from whom the
    # dispatcher (bounded memory of closed tasks) issued it to.
    intake = make_intake()
    submit(intake, 2)
    t = issue(intake)[0]
    assert isinstance(intake.judge(t.node_id, answer(t), 1.0, 0), Accept)
    intake.book.buffered(t.task_id, 0)  # its rows trained: the entry and its hash are gone
    assert t.task_id not in intake.book
    other = "B" if t.node_id == "A" else "A"
    stolen = Result(**{**answer(t, node=other).__dict__, "task_hash": bytes(32)})
    v = intake.judge(other, stolen, 2.0, 0)
    assert isinstance(v, Punish) and "task hash" in v.error.message
    # the node the task was issued to only hears it is a duplicate
    dup = intake.judge(t.node_id, answer(t), 2.0, 0)
    assert isinstance(dup, Refuse) and dup.code == "duplicate"
