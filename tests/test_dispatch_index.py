"""The dispatcher's indexed decisions equal the full scan they replaced (issue 20): the same
random event sequences drive two dispatchers, one deciding with the index and one with the
scan over every node and task that ``next_tasks`` and ``groups_to_count_on`` did before."""

from __future__ import annotations

import math
import random

import pytest

from echo2.learner_hub.dispatch import DispatchConfig, Dispatcher, PromptGroup, TaskAssignment


def scan_next_tasks(d: Dispatcher, now: float, learner_version: int) -> list[TaskAssignment]:
    """``Dispatcher.next_tasks`` as it was before the index (commit d020cf7), verbatim but for
    the median, which it recomputed from every node."""
    cfg = d.config
    out: list[TaskAssignment] = []
    min_version = max(0, learner_version - cfg.staleness)
    timed_rates = sorted(st.rate for st in d.nodes.values() if not st.claimed)
    ref = timed_rates[len(timed_rates) // 2] if timed_rates else None

    def planning_rate(nid: str) -> float:
        st = d.nodes[nid]
        return st.rate if not st.claimed or ref is None else min(st.rate, ref)

    weight = {nid: planning_rate(nid) for nid, st in d.nodes.items() if st.active}
    order = sorted((st for st in d.nodes.values() if st.active), key=lambda s: (-weight[s.node_id], s.node_id))
    progress = True
    slots = max(cfg.probation_max_in_flight, sum(1 for st in order if not st.claimed))
    probation_slots = slots - sum(len(st.in_flight) for st in order if st.claimed)
    untimed = sorted((weight[st.node_id] for st in order if st.claimed), reverse=True)
    total_rate = sum(weight[st.node_id] for st in order if not st.claimed) + sum(untimed[:slots]) or 1.0
    queued = len(d.queue)
    while d.queue and progress:
        progress = False
        for st in order:
            if not d.queue:
                break
            if len(st.in_flight) >= (1 if st.claimed else cfg.max_in_flight_per_node):
                continue
            share = max(1, math.ceil(queued * weight[st.node_id] / total_rate))
            if st.claimed:
                if probation_slots <= 0:
                    continue
                probation_slots -= 1
                share = min(share, cfg.probation_groups)
            out.append(d._make_task(now, st, min_version, share))
            progress = True
    return out


def scan_count_on(d: Dispatcher, now: float) -> int:
    n = 0
    for t in d.in_flight.values():
        st = d.nodes.get(t.node_id)
        if st is not None and not st.claimed and now <= t.issued_at + 2 * t.expected_s + 1.0:
            n += len(t.groups)
    return n


def view(tasks: list[TaskAssignment]) -> list[tuple[str, str, tuple[str, ...], float]]:
    return [(t.task_id, t.node_id, tuple(g.prompt_id for g in t.groups), t.deadline) for t in tasks]


@pytest.mark.parametrize("seed", range(12))
def test_indexed_dispatch_equals_the_scan(seed: int) -> None:
    rng = random.Random(seed)
    cfg = DispatchConfig(staleness=1, target_task_s=rng.choice([1.0, 4.0, 20.0]), min_deadline_s=5.0,
                         max_deadline_s=60.0, probation_max_in_flight=rng.choice([1, 4]))
    new, old = Dispatcher(cfg, task_id_prefix="t"), Dispatcher(cfg, task_id_prefix="t")
    both = (new, old)
    now, prompt, issued = 0.0, 0, 0
    for _ in range(400):
        now += rng.choice([0.0, 0.1, 0.5, 3.0])
        ev = rng.random()
        if ev < 0.12:
            nid = f"n{rng.randrange(40)}"
            rate, claimed = rng.choice([0.25, 0.5, 1.0, 2.0, 4.0, 8.0]), rng.random() < 0.4
            for d in both:
                d.add_node(nid, rate, claimed=claimed)
        elif ev < 0.2:
            k = rng.randrange(8)
            gs = [PromptGroup(f"p{prompt + i}", (1, 2), rng.choice([1, 2, 4])) for i in range(k)]
            prompt += k
            for d in both:
                d.submit(gs)
        elif ev < 0.25 and new.nodes:
            wanted = [n for n in new.nodes if rng.random() < 0.7]
            for d in both:
                d.set_active(wanted)
        elif ev < 0.3 and new.nodes:
            nid, on = rng.choice(sorted(new.nodes)), rng.random() < 0.5
            for d in both:
                d.set_node_active(nid, on)
        elif ev < 0.55 and new.in_flight:
            t = rng.choice(list(new.in_flight.values()))
            version = rng.choice([0, 0, 0, -1])
            for d in both:
                d.on_result(now, t.task_id, t.node_id, version, 0, t.n_rollouts)
        elif ev < 0.58 and new.in_flight:
            t = rng.choice(list(new.in_flight.values()))
            for d in both:
                d.on_decline(t.task_id, t.node_id)
        elif ev < 0.6 and new.nodes:
            nid = rng.choice(sorted(new.nodes))
            assert new.on_node_left(nid) == old.on_node_left(nid)
        elif ev < 0.65:
            scan = [t.task_id for t in reversed(new.in_flight.values()) if now > t.deadline]
            assert new.expire(now) == old.expire(now) == scan
        elif ev < 0.68 and new.nodes:
            nid = rng.choice(sorted(new.nodes))
            for d in both:
                d.nodes[nid].claimed = False  # timed behind the dispatcher's back (as tests do)
        else:
            a, b = new.next_tasks(now, 0), scan_next_tasks(old, now, 0)
            assert view(a) == view(b)
            issued += len(a)
        assert new.groups_to_count_on(now) == scan_count_on(old, now) == scan_count_on(new, now)
        assert list(new.queue) == list(old.queue)
    assert issued > 20  # the sequences did dispatch


def test_count_on_asked_about_an_earlier_moment_scans() -> None:
    d = Dispatcher(DispatchConfig(staleness=1, target_task_s=1.0), task_id_prefix="t")
    d.add_node("a", 4.0)
    d.submit([PromptGroup("p0", (1,), 4)])
    (t,) = d.next_tasks(100.0, 0)
    late = t.issued_at + 2 * t.expected_s + 2.0
    assert d.groups_to_count_on(late) == 0
    assert d.groups_to_count_on(100.0) == 1  # earlier again: answered by the scan, not the index


@pytest.mark.parametrize("seed", range(20))
def test_held_versions_find_the_nodes_a_moving_bound_passes(seed: int) -> None:
    """HeldVersions.between(lo, hi) is exactly the nodes whose held version is in [lo, hi), after
    any sequence of nodes loading versions and leaving (the outbox's eligibility per step)."""
    from echo2.learner_hub.dispatch_index import HeldVersions

    rng = random.Random(seed)
    idx, ref = HeldVersions(), {}
    for _ in range(300):
        p = f"n{rng.randrange(40)}"
        if rng.random() < 0.15:
            idx.held(p, None)
            ref.pop(p, None)
        else:
            v = rng.randrange(-1, 30)
            idx.held(p, v)
            ref[p] = v
        lo = rng.randrange(-1, 30)
        hi = lo + rng.choice([0, 1, 2, 5, 40])
        assert sorted(idx.between(lo, hi)) == sorted(q for q, w in ref.items() if lo <= w < hi)
        assert len(idx) == len(ref)


@pytest.mark.parametrize("seed", range(12))
def test_bounded_plans_make_the_decisions_of_one_unbounded_plan(seed: int) -> None:
    """The hub issues tasks a slice per pass of its loop (Outbox.pump_slice): a chain of
    next_tasks(limit=k) calls, each resuming where the last stopped, hands out the same tasks, in
    the same order and with the same shares, as one call without a limit."""
    rng = random.Random(seed)
    cfg = DispatchConfig(staleness=1, target_task_s=rng.choice([1.0, 4.0, 20.0]), min_deadline_s=5.0,
                         max_deadline_s=60.0, probation_max_in_flight=rng.choice([1, 4]),
                         max_in_flight_per_node=rng.choice([1, 2, 3]))
    whole, sliced = Dispatcher(cfg, task_id_prefix="t"), Dispatcher(cfg, task_id_prefix="t")
    for i in range(rng.randrange(5, 60)):
        rate, claimed = rng.choice([0.25, 0.5, 1.0, 2.0, 4.0, 8.0]), rng.random() < 0.3
        for d in (whole, sliced):
            d.add_node(f"n{i}", rate, claimed=claimed)
    limit = rng.choice([1, 2, 3, 7, 16])
    for _ in range(3):  # a few refills, each planned whole or in a chain of slices
        gs = [PromptGroup(f"p{rng.random()}", (1, 2), rng.choice([1, 2, 4])) for _ in range(rng.randrange(1, 200))]
        for d in (whole, sliced):
            d.submit(gs)
        want = whole.next_tasks(0.0, 0)
        got: list[TaskAssignment] = []
        calls = 0
        while True:
            part = sliced.next_tasks(0.0, 0, limit=limit)
            assert len(part) <= limit
            got += part
            calls += 1
            if len(part) < limit:
                break
        assert view(got) == view(want)
        assert calls >= len(want) // limit
        assert list(sliced.queue) == list(whole.queue)
        for t in want[: len(want) // 2]:  # some finish before the next refill
            for d in (whole, sliced):
                d.on_result(1.0, t.task_id, t.node_id, 0, 0, t.n_rollouts)
