"""The dispatcher's indexes: what :meth:`Dispatcher.next_tasks` and
:meth:`Dispatcher.groups_to_count_on` read, kept up to date as nodes and tasks change instead of
rebuilt from every node and every task on each message.

Measured before (``echo2 bench intake``, one run on this shared machine): a small result cost the
hub's loop 1.5 ms of CPU with 100 nodes and 163 ms with 10,000, most of it sorting and summing
all nodes in ``next_tasks`` and ``set_active`` and scanning all tasks in ``groups_to_count_on``,
twice per result (the result's refill and the heartbeat's pump).

* :class:`NodeIndex`: the hub-timed rates of all nodes, sorted (their median weighs nodes on
  probation), the active timed nodes with a free task slot in dispatch order ``(-rate, id)``,
  their count and exact rate sum, and the active nodes on probation. A node is re-indexed when
  its rate, probation, activity or task count changes (``NodeState`` reports the first three on
  assignment; the dispatcher the last). Insertion into a sorted list is a binary search and a
  memmove: microseconds at 10,000 nodes.
* :class:`CountOn`: the prompt groups in flight on timed nodes whose tasks are not yet overdue,
  as a running total and a heap of the moments each task stops counting.

Nodes on probation are not indexed by order: ``next_tasks`` sorts them per call (their weight is
capped by the fleet's median, which moves with every timed result). There are few of them
(``probation_max_in_flight`` tasks at a time), but a flood of fresh identities makes that sort
grow with the flood.
"""

from __future__ import annotations

import bisect
import heapq
import math
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from .dispatch import Dispatcher, NodeState, TaskAssignment


class _Node(Protocol):
    node_id: str
    rate: float
    active: bool
    claimed: bool
    in_flight: set[str]


_SCALE = 1 << 1074


class NodeIndex:
    def __init__(self, max_in_flight: int) -> None:
        self.max_in_flight = max_in_flight
        self.timed_rates: list[float] = []  # every timed node's rate, sorted
        self.free_timed: list[tuple[float, str]] = []  # active timed nodes with a free slot, (-rate, id)
        self.active_timed = 0
        # exact, in units of 2**-1074 (every finite float is a whole number of them): a float
        # running sum drifts with every add and remove, and each node's share of the queue is a
        # ceiling of rate / total. (Fraction was exact too, but its gcds on 1000-bit numbers cost
        # ~0.4 ms per rate change.)
        self._active_timed_sum = 0
        self.claimed_active: set[str] = set()
        self._indexed: dict[str, tuple[float, bool, bool, bool]] = {}  # id -> (rate, claimed, active, free)
        # where a bounded plan() stopped: (last key walked, queue length of the shares, progress)
        self.resume: tuple[tuple[float, str], int, bool] | None = None

    def cap(self, st: _Node) -> int:
        return 1 if st.claimed else self.max_in_flight

    def free(self, st: _Node) -> bool:
        return len(st.in_flight) < self.cap(st)

    @property
    def active_timed_sum(self) -> float:
        return self._active_timed_sum / _SCALE  # int / int: correctly rounded

    def reference_rate(self) -> float | None:
        """The median hub-timed rate (upper median), as ``Dispatcher._reference_rate`` defines it."""
        r = self.timed_rates
        return r[len(r) // 2] if r else None

    def update(self, st: _Node) -> None:
        new = (st.rate, st.claimed, st.active, self.free(st))
        old = self._indexed.get(st.node_id)
        if old == new:
            return
        if old is not None:
            self._apply(st.node_id, old, -1)
        self._indexed[st.node_id] = new
        self._apply(st.node_id, new, +1)

    def remove(self, node_id: str) -> None:
        old = self._indexed.pop(node_id, None)
        if old is not None:
            self._apply(node_id, old, -1)

    def _apply(self, node_id: str, entry: tuple[float, bool, bool, bool], sign: int) -> None:
        rate, claimed, active, free = entry
        if not claimed:
            _sorted_change(self.timed_rates, rate, sign)
            if active:
                self.active_timed += sign
                num, den = rate.as_integer_ratio()
                self._active_timed_sum += sign * num * (_SCALE // den)
                if free:
                    _sorted_change(self.free_timed, (-rate, node_id), sign)
        elif active:
            if sign > 0:
                self.claimed_active.add(node_id)
            else:
                self.claimed_active.discard(node_id)


def _sorted_change(seq: list[Any], item: Any, sign: int) -> None:
    if sign > 0:
        bisect.insort(seq, item)
    else:
        i = bisect.bisect_left(seq, item)
        if i < len(seq) and seq[i] == item:
            del seq[i]


class Deadlines:
    """Tasks by deadline: ``Dispatcher.expire`` pops the overdue ones instead of scanning every
    task in flight each second (closed tasks leave their entry to be skipped when due)."""

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, str]] = []
        self._seq = 0

    def add(self, task_id: str, deadline: float) -> None:
        self._seq += 1
        heapq.heappush(self._heap, (deadline, self._seq, task_id))

    def due(self, now: float, in_flight: dict[str, TaskAssignment]) -> list[TaskAssignment]:
        """The tasks in flight with ``now > deadline``, newest first (in issue order, reversed)."""
        out: list[tuple[int, TaskAssignment]] = []
        heap = self._heap
        while heap and heap[0][0] < now:
            deadline, seq, tid = heapq.heappop(heap)
            t = in_flight.get(tid)
            if t is not None and t.deadline == deadline:
                out.append((seq, t))
        out.sort(key=lambda e: e[0], reverse=True)
        return [t for _, t in out]


class CountOn:
    """Prompt groups in flight that the pipeline may count on: tasks of timed nodes until
    ``issued_at + 2 * expected_s + 1`` (see ``Dispatcher.groups_to_count_on``)."""

    def __init__(self) -> None:
        self.total = 0
        self._tasks: dict[str, tuple[float, int, str]] = {}  # task id -> (until, groups, node)
        self._counted: set[str] = set()
        self._overdue: set[str] = set()  # popped from the heap: never counted again
        self._heap: list[tuple[float, str]] = []
        self.last_now = -float("inf")

    def opened(self, task_id: str, node_id: str, until: float, groups: int, timed: bool) -> None:
        self._tasks[task_id] = (until, groups, node_id)
        heapq.heappush(self._heap, (until, task_id))
        if timed:
            self._counted.add(task_id)
            self.total += groups

    def closed(self, task_id: str) -> None:
        entry = self._tasks.pop(task_id, None)
        self._overdue.discard(task_id)
        if entry is not None and task_id in self._counted:
            self._counted.discard(task_id)
            self.total -= entry[1]

    def node_timed(self, task_ids: Iterable[str], timed: bool) -> None:
        """A node's probation began or ended: its tasks in flight count (or stop counting)."""
        for tid in task_ids:
            entry = self._tasks.get(tid)
            if entry is None or tid in self._overdue or (tid in self._counted) == timed:
                continue
            if timed:
                self._counted.add(tid)
                self.total += entry[1]
            else:
                self._counted.discard(tid)
                self.total -= entry[1]

    def at(self, now: float) -> int | None:
        """The count at ``now``; None if ``now`` is before an earlier query (tasks that stopped
        counting are not brought back: the caller scans instead)."""
        if now < self.last_now:
            return None
        self.last_now = now
        heap = self._heap
        while heap and heap[0][0] < now:
            _, tid = heapq.heappop(heap)
            entry = self._tasks.get(tid)
            if entry is None:
                continue
            self._overdue.add(tid)
            if tid in self._counted:
                self._counted.discard(tid)
                self.total -= entry[1]
        return self.total


class HeldVersions:
    """The nodes by the version each holds (the outbox's eligibility: only nodes holding a version
    >= the oldest admissible one get tasks). When that bound moves up a learner step, the nodes
    that fall behind are the ones in the versions it passes, instead of a pass over every node
    (~2.5 us a node: 25 ms of loop per step at 10,000 nodes)."""

    def __init__(self) -> None:
        self._at: dict[str, int] = {}
        self._by: dict[int, set[str]] = {}

    def __len__(self) -> int:
        return len(self._at)

    def held(self, peer: str, version: int | None) -> None:
        """``peer`` holds ``version`` now (None: it is gone)."""
        old = self._at.pop(peer, None)
        if old is not None:
            bucket = self._by[old]
            bucket.discard(peer)
            if not bucket:
                del self._by[old]
        if version is not None:
            self._at[peer] = version
            self._by.setdefault(version, set()).add(peer)

    def between(self, lo: int, hi: int) -> list[str]:
        """The nodes holding a version in [lo, hi)."""
        if hi - lo > len(self._by):
            return [p for v, ps in self._by.items() if lo <= v < hi for p in ps]
        return [p for v in range(lo, hi) for p in self._by.get(v, ())]


_ROUND_START = (-math.inf, "")  # before every key (-rate, id): rates are finite


def plan(d: Dispatcher, now: float, learner_version: int, limit: int | None = None) -> list[TaskAssignment]:
    """``Dispatcher.next_tasks``: the same decisions as walking every active node in order
    ``(-weight, id)`` round by round, but walking only the timed nodes with a free slot (from the
    index) merged with the active nodes on probation.

    A round hands each node in order one task while the queue lasts; the next round starts over
    with the nodes still free. The index is re-read between rounds, never changed during one.

    ``limit``: at most that many tasks; the walk stops there and the next call resumes it where it
    stopped (``NodeIndex.resume``: the last key walked, the queue's length the shares were cut from,
    whether the round had handed out anything), so a chain of bounded calls makes the decisions one
    unbounded call makes. Why bounded: the pump after a learner step or a batch of results issued
    thousands of tasks in one step of the hub's loop (~240 ms at 10,000 nodes, the loop's lag p99 in
    `echo2 bench intake`); the hub issues them a slice per pass of its loop instead.
    """
    cfg, idx = d.config, d.index
    out: list[TaskAssignment] = []
    if not d.queue:
        idx.resume = None
        return out
    min_version = max(0, learner_version - cfg.staleness)
    ref = idx.reference_rate()
    claimed: list[tuple[tuple[float, str], NodeState, float]] = []
    for nid in idx.claimed_active:
        st = d.nodes[nid]
        w = st.rate if ref is None else min(st.rate, ref)
        claimed.append(((-w, nid), st, w))
    claimed.sort(key=lambda c: c[0])
    # untimed nodes weigh in only as many as may hold a task: at least one slot per timed node
    slots = max(cfg.probation_max_in_flight, idx.active_timed)
    probation_slots = slots - sum(len(st.in_flight) for _, st, _ in claimed)
    untimed = sorted((w for _, _, w in claimed), reverse=True)
    total_rate = idx.active_timed_sum + sum(untimed[:slots]) or 1.0
    resume, idx.resume = idx.resume, None
    queued = len(d.queue) if resume is None else resume[1]
    progress = True
    while d.queue and progress:
        progress = False
        timed, touched = idx.free_timed, []
        i = j = 0
        last: tuple[float, str] = _ROUND_START
        if resume is not None:  # the rest of a round an earlier call stopped in
            last, progress = resume[0], resume[2]
            i, j = bisect.bisect_right(timed, last), bisect.bisect_right(claimed, last, key=lambda c: c[0])
            resume = None
        while d.queue:
            if limit is not None and len(out) >= limit:
                idx.resume = (last, queued, progress)
                break
            if j < len(claimed) and (i >= len(timed) or claimed[j][0] < timed[i]):
                last, st, w = claimed[j]
                j += 1
                if st.in_flight or probation_slots <= 0:
                    continue
                probation_slots -= 1
                share = min(max(1, math.ceil(queued * w / total_rate)), cfg.probation_groups)
            elif i < len(timed):
                last = timed[i]
                st = d.nodes[last[1]]
                i += 1
                if len(st.in_flight) >= cfg.max_in_flight_per_node:
                    touched.append(st)  # filled behind the index's back: re-indexed below
                    continue
                share = max(1, math.ceil(queued * st.rate / total_rate))
            else:
                break
            out.append(d._make_task(now, st, min_version, share))
            touched.append(st)
            progress = True
        for st in touched:
            idx.update(st)
        if idx.resume is not None:
            break
    return out
