"""Dispatcher and replay buffer: sizing, deadlines, idempotence, staleness boundary, requeueing."""

from __future__ import annotations

import pytest

from echo2.learner_hub.dispatch import (
    DispatchConfig,
    Dispatcher,
    PromptGroup,
    ReplayBuffer,
    VerdictCode,
    admissible,
)


def groups(n: int, size: int = 4, start: int = 0) -> list[PromptGroup]:
    return [PromptGroup(f"p{i}", (1, i + 3), size) for i in range(start, start + n)]


def make(staleness: int = 1, **kw: float) -> Dispatcher:
    cfg = DispatchConfig(staleness=staleness, **kw)  # type: ignore[arg-type]
    return Dispatcher(cfg, task_id_prefix="t")


def test_task_sized_by_rate_and_deadline() -> None:
    d = make(
        target_task_s=20.0,
        deadline_slack=3.0,
        min_deadline_s=10.0,
        max_deadline_s=100.0,
        max_in_flight_per_node=1,
    )
    d.submit(groups(100))
    d.add_node("fast", 2.0)  # 40 rollouts per 20 s -> 10 groups of 4
    d.add_node("slow", 0.01)  # less than one group -> still 1 group
    tasks = d.next_tasks(now=1000.0, learner_version=5)
    by = {t.node_id: t for t in tasks}
    assert len(by["fast"].groups) == 10 and by["fast"].n_rollouts == 40
    assert by["fast"].expected_s == pytest.approx(20.0)
    assert by["fast"].deadline == pytest.approx(1000.0 + 60.0)  # 3 x 20 s
    assert len(by["slow"].groups) == 1
    assert by["slow"].deadline == pytest.approx(1000.0 + 100.0)  # clamped to max
    assert by["fast"].min_version == 4 and by["fast"].max_version_lag == 1
    assert by["fast"].task_id != by["slow"].task_id
    # prompts handed out in queue order, fastest node first
    assert [g.prompt_id for g in by["fast"].groups] == [f"p{i}" for i in range(10)]
    assert by["slow"].groups[0].prompt_id == "p10"
    assert by["fast"].prompts[0] == [1, 3]


def test_min_version_floor_and_cap() -> None:
    d = make(staleness=3, max_prompts_per_task=5)
    d.submit(groups(20))
    d.add_node("n", 1000.0)
    (t,) = d.next_tasks(0.0, learner_version=1)[:1]
    assert t.min_version == 0  # max(0, 1 - 3)
    assert len(t.groups) == 5  # capped by max_prompts_per_task


def test_max_in_flight_per_node() -> None:
    d = make(max_in_flight_per_node=2, target_task_s=1.0)
    d.submit(groups(10))
    d.add_node("n", 4.0)  # one group of 4 per task
    assert len(d.next_tasks(0.0, 0)) == 2
    assert d.next_tasks(0.1, 0) == []
    t = next(iter(d.in_flight.values()))
    assert d.on_result(1.0, t.task_id, "n", 0, 0, 4).accepted
    assert len(d.next_tasks(1.0, 0)) == 1
    # a deactivated node gets nothing new
    d.set_active([])
    t2 = next(iter(d.in_flight.values()))
    d.on_result(2.0, t2.task_id, "n", 0, 0, 4)
    assert d.next_tasks(2.0, 0) == []


def test_duplicate_result_is_idempotent() -> None:
    d = make()
    d.submit(groups(3))
    d.add_node("n", 0.6)
    (t,) = d.next_tasks(0.0, 0)
    v1 = d.on_result(5.0, t.task_id, "n", 0, 0, t.n_rollouts)
    assert v1.code is VerdictCode.ACCEPTED and not v1.late
    v2 = d.on_result(6.0, t.task_id, "n", 0, 0, t.n_rollouts)
    assert v2.code is VerdictCode.DUPLICATE
    assert d.stats.accepted == 1 and d.stats.accepted_rollouts == t.n_rollouts
    assert d.stats.refused_by_reason == {"duplicate": 1}
    assert d.on_result(6.0, "nope", "n", 0, 0, 4).code is VerdictCode.UNKNOWN_TASK


def test_wrong_node_and_wrong_count_and_below_min_version() -> None:
    d = make(staleness=1, target_task_s=1.0)
    d.submit(groups(3))
    d.add_node("n", 4.0)
    d.add_node("m", 4.0)
    tasks = d.next_tasks(0.0, learner_version=5)
    t = next(x for x in tasks if x.node_id == "n")
    assert d.on_result(1.0, t.task_id, "m", 5, 5, 4).code is VerdictCode.WRONG_NODE
    assert t.task_id in d.in_flight  # the real node can still deliver
    assert d.on_result(1.0, t.task_id, "n", 3, 5, 4).code is VerdictCode.BELOW_MIN_VERSION  # min is 4
    assert d.queue[0] == t.groups[0]  # prompts back at the front
    assert d.on_result(1.0, t.task_id, "n", 5, 5, 4).code is VerdictCode.REASSIGNED
    t2 = next(x for x in tasks if x.node_id == "m")
    assert d.on_result(1.0, t2.task_id, "m", 5, 5, 3).code is VerdictCode.WRONG_COUNT
    assert d.stats.accepted == 0


def test_expiry_requeues_and_late_result_is_refused() -> None:
    d = make(target_task_s=10.0, deadline_slack=2.0, min_deadline_s=1.0, max_in_flight_per_node=1)
    d.submit(groups(4))
    d.add_node("a", 0.8)  # 8 rollouts per 10 s -> 2 groups, deadline now + 20
    (t,) = d.next_tasks(0.0, 0)
    assert t.deadline == pytest.approx(20.0)
    d.submit(groups(1, start=50))
    assert d.expire(19.9) == []
    assert d.expire(20.1) == [t.task_id]
    # prompts back at the front, in their original order, ahead of later submissions
    assert [g.prompt_id for g in list(d.queue)[:3]] == ["p0", "p1", "p2"]
    late = d.on_result(25.0, t.task_id, "a", 0, 0, t.n_rollouts)
    assert late.code is VerdictCode.REASSIGNED
    assert d.stats.accepted == 0 and d.stats.expired == 1
    d.add_node("b", 0.8)
    again = d.next_tasks(26.0, 0)
    assert any(x.groups == t.groups for x in again)
    assert all(x.task_id != t.task_id for x in again)


def test_late_result_before_expire_is_accepted_and_flagged() -> None:
    d = make(target_task_s=10.0, deadline_slack=1.0, min_deadline_s=1.0)
    d.submit(groups(1))
    d.add_node("a", 0.4)
    (t,) = d.next_tasks(0.0, 0)
    v = d.on_result(t.deadline + 5.0, t.task_id, "a", 0, 0, t.n_rollouts)
    assert v.accepted and v.late
    assert d.expire(t.deadline + 6.0) == []


def test_stale_boundary_exact() -> None:
    # S = 2, learner at step t = 10: version 8 (= t - S) admitted, 7 (= t - S - 1) dropped
    assert admissible(8, 10, 2) and not admissible(7, 10, 2)
    d = make(staleness=2, target_task_s=1.0)
    d.submit(groups(2))
    d.add_node("a", 4.0)
    d.add_node("b", 4.0)
    ta, tb = d.next_tasks(0.0, learner_version=9)  # min_version 7
    assert d.on_result(1.0, ta.task_id, ta.node_id, 8, 10, 4).code is VerdictCode.ACCEPTED
    v = d.on_result(1.0, tb.task_id, tb.node_id, 7, 10, 4)
    assert v.code is VerdictCode.STALE
    assert d.stats.stale_dropped == 1 and d.stats.accepted == 1
    assert list(d.queue) == list(tb.groups)  # its prompts still need fresh rollouts
    assert d.on_result(2.0, tb.task_id, tb.node_id, 7, 10, 4).code is VerdictCode.DUPLICATE
    assert d.stats.stale_dropped == 1


def test_node_left_and_decline_requeue_at_front() -> None:
    d = make(target_task_s=1.0, max_in_flight_per_node=2)
    d.submit(groups(6))
    d.add_node("a", 4.0)
    d.add_node("b", 3.9)
    tasks = d.next_tasks(0.0, 0)  # a: p0, p2; b: p1, p3 (round robin)
    assert [t.groups[0].prompt_id for t in tasks] == ["p0", "p1", "p2", "p3"]
    ids = d.on_node_left("a")
    assert sorted(ids) == sorted(t.task_id for t in tasks if t.node_id == "a")
    assert [g.prompt_id for g in d.queue] == ["p0", "p2", "p4", "p5"]
    assert "a" not in d.nodes and d.on_node_left("a") == []
    tb = next(t for t in tasks if t.node_id == "b")
    assert not d.on_decline(tb.task_id, "a", "not yours")
    assert d.on_decline(tb.task_id, "b", "out of memory")
    assert d.queue[0].prompt_id == "p1"
    assert d.on_result(1.0, tb.task_id, "b", 0, 0, 4).code is VerdictCode.REASSIGNED
    assert d.on_result(1.0, ids[0], "a", 0, 0, 4).code is VerdictCode.REASSIGNED


def test_rate_ewma_from_hub_timing() -> None:
    d = make(target_task_s=10.0, ewma_alpha=0.5, max_in_flight_per_node=1)
    d.submit(groups(20, size=2))
    d.add_node("n", 1.0)  # 10 rollouts -> 5 groups
    (t,) = d.next_tasks(100.0, 0)
    assert t.n_rollouts == 10
    d.on_result(105.0, t.task_id, "n", 0, 0, 10)  # observed 2/s -> 0.5*2 + 0.5*1
    assert d.rate_of("n") == pytest.approx(1.5)
    (t2,) = d.next_tasks(105.0, 0)
    assert t2.n_rollouts == 14  # 15 budget, groups of 2


def test_pipelined_tasks_timed_from_previous_result() -> None:
    d = make(target_task_s=4.0, ewma_alpha=1.0, max_in_flight_per_node=2)
    d.submit(groups(2, size=4))
    d.add_node("n", 1.0)
    t1, t2 = d.next_tasks(0.0, 0)
    assert t2.deadline > t1.deadline  # the second waits behind the first
    d.on_result(4.0, t1.task_id, "n", 0, 0, 4)
    d.on_result(6.0, t2.task_id, "n", 0, 0, 4)  # ran 4..6 -> 2/s, not 4/6 s
    assert d.rate_of("n") == pytest.approx(2.0)


def test_results_delivered_together_are_timed_as_one_span() -> None:
    # a node's ResultBatch: both tasks were made serially in 0..8, the results arrive at once
    d = make(target_task_s=4.0, ewma_alpha=0.5, max_in_flight_per_node=2)
    d.submit(groups(2, size=4))
    d.add_node("n", 1.0)
    t1, t2 = d.next_tasks(0.0, 0)
    d.on_result(8.0, t1.task_id, "n", 0, 0, 4)
    d.on_result(8.0, t2.task_id, "n", 0, 0, 4)  # 8 rollouts in 8 s, not 4 in 8 s then 4 in no time
    assert d.rate_of("n") == pytest.approx(0.5 * 1.0 + 0.5 * 1.0)
    # one result alone afterwards is a timing of its own, weighed into the batch's
    d.submit(groups(1, size=4))
    (t3,) = d.next_tasks(8.0, 0)
    d.on_result(10.0, t3.task_id, "n", 0, 0, 4)
    assert d.rate_of("n") == pytest.approx(0.5 * 2.0 + 0.5 * 1.0)


def test_buffer_admission_boundary_and_ageing() -> None:
    buf: ReplayBuffer[str] = ReplayBuffer(staleness=2)
    assert buf.add("g8", 8, learner_step=10)
    assert not buf.add("g7", 7, learner_step=10)
    assert buf.stale_dropped == 1 and buf.accepted == 1
    assert buf.add("g10", 10, 10) and buf.add("g9", 9, 10)
    assert buf.take_batch(10, 4) is None and len(buf) == 3  # not enough: nothing removed
    assert buf.take_batch(10, 2) == [(8, "g8"), (9, "g9")]  # oldest first
    buf.add("g11", 11, 11)
    # at step 13 version 10 is 13 - 3 -> aged out and counted
    assert buf.take_batch(13, 1) == [(11, "g11")]
    assert buf.stale_dropped == 2 and buf.refused_by_reason == {"stale": 2}
    assert len(buf) == 0


def test_buffer_evicts_oldest_when_full() -> None:
    buf: ReplayBuffer[int] = ReplayBuffer(staleness=5, max_items=2)
    for v in (3, 1, 2):
        buf.add(v, v, 3)
    assert buf.versions() == [2, 3]
    assert buf.refused_by_reason == {"evicted": 1}


def test_config_validation() -> None:
    with pytest.raises(ValueError):
        DispatchConfig(staleness=-1)
    with pytest.raises(ValueError):
        DispatchConfig(ewma_alpha=0.0)
    with pytest.raises(ValueError):
        PromptGroup("x", (1,), 0)
